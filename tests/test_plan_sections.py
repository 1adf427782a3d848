"""Plan tables as plugin components: the ``register_plan_sections`` hook. The sweep command owns
``[sweep]`` and the distributed engines own ``[distributed]`` through it, and a third party's table
(``[notes]`` of ``examples/ftcore-example-command``) is validated by ``ftcore validate`` the same way."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from test_plugin_manager import add_dist, ftcore_cli, lines_with

from ftcore.errors import PlanError
from ftcore.plan import load_plan
from ftcore.plugins import PluginInfo, get_plugin_manager

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "ftcore-example-command" / "ftcore_example_command" / "__init__.py"

STAGE = '\n[[stage]]\ntrainer = "sft"\ndata = "chat"\nmax_steps = 2\n'


def example_registry():
    """The built-in plugins and the example command package, loaded from its source."""
    spec = importlib.util.spec_from_file_location("ftcore_example_command", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    pm = get_plugin_manager(entry_points=False)
    pm.add_plugin(module, PluginInfo("example-command", "ftcore-example-command", "0.1.0", "entry point"))
    return pm.registry()


def test_the_builtin_tables_are_owned_by_their_plugins():
    registry = get_plugin_manager(entry_points=False).registry()
    owners = {name: [r.plugin for r in regs] for name, regs in registry.sections.items()}
    assert owners == {"distributed": ["ftcore_plugins.trainers.distributed"],
                      "requires": ["ftcore_plugins.commands.plugins"],
                      "sweep": ["ftcore_plugins.commands.sweep"],
                      "track": ["ftcore_plugins.trackers.track"]}
    assert not registry.problems
    # The kernel names none of these tables: the plan reads them through the hook.
    for module in ("plan.py", "runner.py", "plugins.py"):
        text = (REPO / "ftcore" / module).read_text()
        assert not any(f'"{table}"' in text for table in owners), module


def test_a_third_party_table_is_validated_and_kept_out_of_the_fingerprint(tiny_project):
    registry = example_registry()
    plain = load_plan(tiny_project(STAGE), registry)
    assert plain.notes is None and plain.sections["notes"].options is None
    noted = load_plan(tiny_project(STAGE + '\n[notes]\nowner = "ana"\ntags = ["a", "b"]\n', "noted.toml"), registry)
    assert (noted.notes.owner, noted.notes.tags) == ("ana", ["a", "b"])
    assert noted.fingerprint() == plain.fingerprint()  # fingerprint = False
    with pytest.raises(PlanError) as err:
        load_plan(tiny_project(STAGE + '\n[notes]\nownr = "ana"\ntags = ["a", "a"]\n', "bad.toml"), registry)
    assert len(err.value.problems) == 1
    assert "bad.toml: notes.ownr: unknown key; did you mean 'owner'?" in err.value.problems[0]
    with pytest.raises(PlanError) as err:  # check(plan), once the rest is valid: its key under the table
        load_plan(tiny_project(STAGE + '\n[notes]\ntags = ["a", "a"]\n', "twice.toml"), registry)
    assert err.value.problems == [f"{tiny_project.dir / 'twice.toml'}: notes.tags: 'a' is listed twice"]


def test_ftcore_validate_checks_the_example_packages_table(tiny_project, tmp_path):
    site = tmp_path / "site"
    add_dist(site, "ftcore-example-command", {"ftcore_example_command": EXAMPLE.read_text()},
             {"example-command": "ftcore_example_command"})
    good = tiny_project(STAGE + '\n[notes]\nowner = "ana"\n', "good.toml")
    r = ftcore_cli("validate", str(good), cwd=tiny_project.dir, site=site)
    assert r.returncode == 0 and ": OK:" in r.stdout, r.stderr
    bad = tiny_project(STAGE + '\n[notes]\nowner = 3\ntagz = []\n', "bad.toml")
    r = ftcore_cli("validate", str(bad), cwd=tiny_project.dir, site=site)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert lines_with(r.stderr, f"{bad}: notes.owner: input should be a valid string"), r.stderr
    assert lines_with(r.stderr, f"{bad}: notes.tagz: unknown key; did you mean 'tags'?"), r.stderr
    assert len(r.stderr.strip().splitlines()) == 2, r.stderr
    # Without the package, the table is not the plan's: one line, naming the tables there are.
    r = ftcore_cli("validate", str(good), cwd=tiny_project.dir)
    assert r.returncode == 2 and lines_with(r.stderr, f"{good}: notes: unknown top-level key"), r.stderr


SECTION = """
import ftcore
from ftcore.component import PlanSection


class Mine(PlanSection):
    name = {name!r}


@ftcore.hookimpl
def register_plan_sections(register):
    register({what})
"""


def test_two_owners_of_one_table_and_a_core_table_are_refused_loudly(tiny_project, tmp_path):
    site = tmp_path / "site"
    add_dist(site, "one-dist", {"one_mod": SECTION.format(name="notes", what="Mine")}, {"one": "one_mod"})
    add_dist(site, "two-dist", {"two_mod": SECTION.format(name="notes", what="Mine")}, {"two": "two_mod"})
    add_dist(site, "core-dist", {"core_mod": SECTION.format(name="model", what="Mine")}, {"core": "core_mod"})
    add_dist(site, "bad-dist", {"bad_mod": SECTION.format(name="x", what="object")}, {"bad": "bad_mod"})
    plain = tiny_project(STAGE)
    r = ftcore_cli("validate", str(plain), cwd=tiny_project.dir, site=site)
    assert r.returncode == 0, r.stderr
    assert len(lines_with(r.stderr, "warning:", "both own the plan table [notes]")) == 1, r.stderr
    assert lines_with(r.stderr, "warning: plugin 'core' (core-dist 1.0) registered an invalid plan section: Mine "
                                "names [model], which is ftcore's own table"), r.stderr
    assert lines_with(r.stderr, "warning: plugin 'bad' (bad-dist 1.0) registered an invalid plan section: expected "
                                "a subclass of ftcore.component.PlanSection"), r.stderr
    noted = tiny_project(STAGE + "\n[notes]\n", "noted.toml")
    r = ftcore_cli("validate", str(noted), cwd=tiny_project.dir, site=site)
    assert r.returncode == 2
    assert lines_with(r.stderr, f"{noted}: notes: the table [notes] is owned by both plugin"), r.stderr
