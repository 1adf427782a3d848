"""The plugin manager, exercised through the real CLI and real entry-point discovery.

Helper plugins are real distributions: a ``<name>-<version>.dist-info`` folder with
``METADATA`` and ``entry_points.txt`` next to the plugin module in ``<tmp>/site``. The
CLI runs in a subprocess with ``PYTHONPATH=<tmp>/site``, so ``importlib.metadata``
discovers them exactly as it discovers a pip-installed package. Nothing is patched.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import INSTALLED_SITES, forked, installed

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "ftcore-example-evaluator"
EXAMPLE_DIST = "ftcore-example-evaluator"


# -- helpers ---------------------------------------------------------------------------------

def add_dist(site: Path, dist: str, modules: dict[str, str], entry_points: dict[str, str] | None = None,
             version: str = "1.0") -> None:
    """Install a distribution by hand into ``site``: its modules and a dist-info folder whose
    entry_points.txt declares ``entry_points`` (name -> module) in the ``ftcore`` group."""
    site.mkdir(parents=True, exist_ok=True)
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    if entry_points:
        lines = "".join(f"{name} = {target}\n" for name, target in entry_points.items())
        (info / "entry_points.txt").write_text(f"[ftcore]\n{lines}")
    for module, source in modules.items():
        (site / f"{module}.py").write_text(textwrap.dedent(source))


def component_module(hook: str, cls_name: str, name: str, method: str, body: str = "return {}") -> str:
    """Source of a plugin module registering one component through ``hook``. Its options
    accept the keys the tiny plan's stage sets, so it can stand in for a trainer."""
    return f"""
import ftcore
from ftcore.component import Component, Options


class {cls_name}(Component):
    \"\"\"A test component.\"\"\"

    name = {name!r}

    class Options(Options):
        max_steps: int = 1
        batch_size: int = 1
        max_length: int = 16
        save_steps: int = 1

    def {method}(self, ctx):
        {body}


@ftcore.hookimpl
def {hook}(register):
    register({cls_name})
"""


def ftcore_cli(*args: str, cwd: Path, site: Path | None = None, env: dict[str, str] | None = None,
               timeout: float = 3600) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FTCORE_") and k != "PYTHONPATH"}
    sites = [*([str(site)] if site is not None else []), *INSTALLED_SITES]  # and the example packages installed
    if sites:
        clean["PYTHONPATH"] = os.pathsep.join(sites)
    clean.update(env or {})
    # A fork of the worker's server where nothing read at import differs (site folders it puts on sys.path).
    done = forked("run", args, clean, cwd=cwd, timeout=timeout)
    if done is not None:
        return done
    return subprocess.run([sys.executable, "-m", "ftcore", *args], cwd=cwd, env=clean, capture_output=True,
                          text=True, timeout=timeout)


def plugins_json(cwd: Path, site: Path | None = None, env: dict[str, str] | None = None) -> dict:
    r = ftcore_cli("plugins", "--json", cwd=cwd, site=site, env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def names(listing: dict, kind: str) -> set[str]:
    return {c["name"] for c in listing["components"][kind]}


def lines_with(text: str, *needles: str) -> list[str]:
    return [line for line in text.splitlines() if all(n in line for n in needles)]


ROWS = [
    {"messages": [{"role": "user", "content": f"Which word is an animal? {a} {b} {c}"},
                  {"role": "assistant", "content": f"the {animal}"}]}
    for a, b, c, animal in [
        ("cat", "red", "runs", "cat"), ("old", "dog", "sees", "dog"), ("blue", "tree", "fox", "fox"),
        ("bird", "king", "large", "bird"), ("slow", "fish", "stone", "fish"), ("warm", "cold", "horse", "horse"),
        ("mouse", "finds", "river", "mouse"), ("queen", "quick", "cat", "cat"),
    ]
]


def write_plan(folder: Path, *, trainer: str = "sft", evaluate: str = "", requires: str = "",
               run_name: str = "t") -> Path:
    """A tiny plan: a 1-layer scratch model, a BPE tokenizer trained on 8 chat rows, 2 steps."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "train.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    plan = folder / f"{run_name}.toml"
    plan.write_text(f"""{requires}
[run]
name = "{run_name}"
output_dir = "runs"

[model]
use = "scratch"
hidden_size = 32
num_layers = 1
num_heads = 2
max_position_embeddings = 128
tokenizer_data = ["train"]
vocab_size = 300

[template]
use = "chatml"

[data.train]
use = "jsonl"
path = "train.jsonl"

[[stage]]
name = "sft"
trainer = "{trainer}"
data = "train"
max_steps = 2
batch_size = 4
max_length = 32
save_steps = 100
{evaluate}
""")
    return plan


# -- plugins that fail to load ------------------------------------------------------------------

def test_plugin_failing_to_import_is_one_warning_and_builtins_still_load(tmp_path):
    site = tmp_path / "site"
    add_dist(site, "broken-dist", {"broken_mod": "import ftcore_test_dependency_that_is_not_installed\n"},
             {"broken-plugin": "broken_mod"})

    r = ftcore_cli("plugins", cwd=tmp_path, site=site)
    assert r.returncode == 0, r.stderr
    assert "sft" in r.stdout and "perplexity" in r.stdout  # the built-in plugins are listed
    warnings = lines_with(r.stderr, "broken")
    assert len(warnings) == 1, r.stderr
    line = warnings[0]
    assert line.startswith("warning: ")
    assert "'broken-plugin'" in line and "broken-dist 1.0" in line  # entry point and distribution
    assert "ftcore_test_dependency_that_is_not_installed" in line  # and why
    assert "Traceback" not in r.stderr

    listing = plugins_json(tmp_path, site)
    assert "sft" in names(listing, "trainer")
    assert "broken-plugin" not in {p["name"] for p in listing["plugins"]}
    assert len(lines_with("\n".join(listing["problems"]), "broken-plugin", "broken-dist")) == 1


def typo_site(tmp_path: Path) -> Path:
    """One plugin implementing the misspelled hook ``register_trainer``, one correct plugin."""
    site = tmp_path / "site"
    add_dist(site, "typo-dist",
             {"typo_mod": component_module("register_trainer", "TypoTrainer", "typo_trainer", "train")},
             {"typo": "typo_mod"})
    add_dist(site, "good-dist",
             {"good_mod": component_module("register_trainers", "GoodTrainer", "good_trainer", "train")},
             {"good": "good_mod"})
    return site


def test_misspelled_hook_is_one_line_naming_the_plugin_and_other_plugins_keep_working(tmp_path):
    site = typo_site(tmp_path)

    r = ftcore_cli("plugins", cwd=tmp_path, site=site)
    assert r.returncode == 0, r.stderr
    reported = lines_with(r.stderr, "typo")
    assert len(reported) == 1, r.stderr
    line = reported[0]
    assert line.startswith("warning: ")
    assert "'typo'" in line and "typo-dist 1.0" in line and "unknown hook 'register_trainer'" in line
    assert "good" not in r.stderr

    listing = plugins_json(tmp_path, site)
    trainers = names(listing, "trainer")
    assert "good_trainer" in trainers and "sft" in trainers
    assert "typo_trainer" not in trainers
    loaded = {p["name"]: p for p in listing["plugins"]}
    assert "typo" not in loaded
    assert loaded["good"]["dist"] == "good-dist" and loaded["good"]["source"] == "entry point"

    # The good plugin's trainer is usable from a plan.
    plan = write_plan(tmp_path, trainer="good_trainer")
    r = ftcore_cli("validate", str(plan), cwd=tmp_path, site=site)
    assert r.returncode == 0, r.stderr
    assert "OK" in r.stdout and "good_trainer" in r.stdout


def test_misspelled_hook_suggests_the_real_hook_name(tmp_path):
    r = ftcore_cli("plugins", cwd=tmp_path, site=typo_site(tmp_path))
    assert r.returncode == 0, r.stderr
    reported = lines_with(r.stderr, "typo")
    assert len(reported) == 1, r.stderr
    assert "did you mean 'register_trainers'?" in reported[0]


# -- two plugins, one name -----------------------------------------------------------------------

def test_same_trainer_name_from_two_plugins_is_a_conflict_resolved_by_qualified_name(tmp_path):
    site = tmp_path / "site"
    for dist, ep, module in (("alpha-dist", "alpha", "alpha_mod"), ("beta-dist", "beta", "beta_mod")):
        add_dist(site, dist, {module: component_module("register_trainers", "Shared", "shared", "train")},
                 {ep: module})

    listing = plugins_json(tmp_path, site)
    shared = [c for c in listing["components"]["trainer"] if c["name"] == "shared"]
    assert sorted(c["qualified"] for c in shared) == ["alpha-dist:shared", "beta-dist:shared"]
    conflicts = [c for c in listing["conflicts"] if "'shared'" in c]
    assert len(conflicts) == 1
    assert "alpha-dist" in conflicts[0] and "beta-dist" in conflicts[0]

    bare = write_plan(tmp_path, trainer="shared", run_name="bare")
    r = ftcore_cli("validate", str(bare), cwd=tmp_path, site=site)
    assert r.returncode == 2, r.stdout + r.stderr
    clash = lines_with(r.stderr, "stage[0].trainer", "alpha-dist", "beta-dist")
    assert len(clash) == 1, r.stderr
    assert "'alpha-dist:shared'" in clash[0] and "'beta-dist:shared'" in clash[0]  # how to choose

    qualified = write_plan(tmp_path, trainer="beta-dist:shared", run_name="qualified")
    r = ftcore_cli("validate", str(qualified), cwd=tmp_path, site=site)
    assert r.returncode == 0, r.stderr
    assert "OK" in r.stdout and "sft (beta-dist:shared, full)" in r.stdout  # as the plan wrote it


def test_a_run_names_a_plugin_trainer_as_the_plan_wrote_it(tmp_path):
    """A plugin's trainer that shares the built-in's name, chosen as ``acme-dup:sft``: the run uses the
    plugin's (it records that it trained) and its stage line says ``trainer 'acme-dup:sft'``, not the
    bare ``'sft'``, which would be the built-in."""
    site = tmp_path / "site"
    marker = tmp_path / "trained-by-acme.txt"
    body = f"open({str(marker)!r}, 'w').write(ctx.stage); return {{}}"
    add_dist(site, "acme-dup", {"acme_mod": component_module("register_trainers", "Dup", "sft", "train", body)},
             {"acme": "acme_mod"})
    plan = write_plan(tmp_path, trainer="acme-dup:sft")
    r = ftcore_cli("validate", str(plan), cwd=tmp_path, site=site)
    assert r.returncode == 0 and "sft (acme-dup:sft, full)" in r.stdout, r.stdout + r.stderr
    r = ftcore_cli("run", str(plan), cwd=tmp_path, site=site)
    assert r.returncode == 0, r.stdout + r.stderr
    assert marker.read_text() == "sft"  # the plugin's trainer ran, not the built-in
    [line] = lines_with(r.stdout, "stage sft: trainer")
    assert line.strip() == "stage sft: trainer 'acme-dup:sft', adapter 'full', data 'train'", line


# -- allow and block lists ------------------------------------------------------------------------

def test_disable_and_load_plugins_environment_variables(tmp_path):
    site = tmp_path / "site"
    log = tmp_path / "imported.txt"
    for dist, ep, module, evaluator in (("one-dist", "one", "one_mod", "one_eval"),
                                        ("two_dist", "two", "two_mod", "two_eval")):
        source = component_module("register_evaluators", "Eval", evaluator, "evaluate")
        # Each module records that it was imported, to prove a blocked plugin is never imported.
        source = f"import os\nwith open(os.environ['FAKE_IMPORT_LOG'], 'a') as fh:\n    fh.write('{ep}\\n')\n" + \
            textwrap.dedent(source)
        add_dist(site, dist, {module: source}, {ep: module})

    def listing(**env: str) -> tuple[set[str], list[str]]:
        log.write_text("")
        out = plugins_json(tmp_path, site, {"FAKE_IMPORT_LOG": str(log), **env})
        return names(out, "evaluator") | names(out, "trainer"), log.read_text().split()

    found, imported = listing()
    assert {"one_eval", "two_eval", "sft", "perplexity"} <= found
    assert sorted(imported) == ["one", "two"]

    # Blocking by entry-point name, or by distribution name (normalized), skips the import.
    for blocked in ("two", "two_dist", "two-dist"):
        found, imported = listing(FTCORE_DISABLE_PLUGINS=blocked)
        assert "two_eval" not in found, blocked
        assert {"one_eval", "sft", "perplexity"} <= found, blocked
        assert imported == ["one"], blocked

    # Built-in plugins can be blocked by module name.
    found, _ = listing(FTCORE_DISABLE_PLUGINS="eval_perplexity, two")
    assert "perplexity" not in found and "two_eval" not in found
    assert {"one_eval", "sft", "exact_match"} <= found

    # The allowlist loads only the third-party plugins named; built-ins stay.
    found, imported = listing(FTCORE_LOAD_PLUGINS="one")
    assert "one_eval" in found and "two_eval" not in found
    assert {"sft", "perplexity"} <= found
    assert imported == ["one"]

    found, imported = listing(FTCORE_LOAD_PLUGINS="two-dist")
    assert "two_eval" in found and "one_eval" not in found
    assert imported == ["two"]


# -- failures at run time -------------------------------------------------------------------------

def test_component_error_at_run_time_is_one_line_naming_the_plugin(tmp_path):
    site = tmp_path / "site"
    body = "raise RuntimeError('kaboom from the evaluator\\nsecond line of detail')"
    add_dist(site, "boom-dist",
             {"boom_mod": component_module("register_evaluators", "Explode", "explode", "evaluate", body)},
             {"boom": "boom_mod"})
    plan = write_plan(tmp_path, evaluate='[[evaluate]]\nuse = "explode"\nwhen = "before"\n')

    r = ftcore_cli("run", str(plan), cwd=tmp_path, site=site)
    assert r.returncode == 1, r.stdout + r.stderr
    errors = lines_with(r.stderr, "error:")
    assert len(errors) == 1, r.stderr
    line = errors[0]
    assert line.startswith("error: ")
    assert "evaluator 'explode'" in line and "plugin 'boom' (boom-dist 1.0)" in line
    assert "evaluate()" in line and "RuntimeError: kaboom from the evaluator" in line
    assert "second line of detail" not in r.stderr
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
    assert "--debug" in r.stderr  # says how to get the traceback
    manifest = json.loads((tmp_path / "runs" / "t" / "manifest.json").read_text())
    assert manifest["status"] == "failed"
    assert "kaboom" in manifest["error"]

    r = ftcore_cli("run", str(plan), "--force", "--debug", cwd=tmp_path, site=site)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" in r.stderr
    assert "RuntimeError: kaboom from the evaluator" in r.stderr
    assert len(lines_with(r.stderr, "error: evaluator 'explode'")) == 1


# -- requires --------------------------------------------------------------------------------------

def test_requires_names_the_missing_distribution_and_the_pip_command(tmp_path):
    site = tmp_path / "site"
    add_dist(site, "present-dist", {}, version="1.0")

    plan = write_plan(tmp_path, requires='requires = ["some-missing-dist>=1.0"]', run_name="missing")
    r = ftcore_cli("validate", str(plan), cwd=tmp_path, site=site)
    assert r.returncode == 2, r.stdout + r.stderr
    problems = lines_with(r.stderr, "requires[0]")
    assert len(problems) == 1, r.stderr
    assert "some-missing-dist" in problems[0]
    assert "pip install 'some-missing-dist>=1.0'" in problems[0]

    plan = write_plan(tmp_path, requires='requires = ["present-dist>=1.0", "present-dist>=2"]', run_name="old")
    r = ftcore_cli("validate", str(plan), cwd=tmp_path, site=site)
    assert r.returncode == 2
    assert not lines_with(r.stderr, "requires[0]")  # 1.0 satisfies >=1.0
    too_old = lines_with(r.stderr, "requires[1]")
    assert len(too_old) == 1 and "1.0 is installed" in too_old[0] and "pip install 'present-dist>=2'" in too_old[0]

    plan = write_plan(tmp_path, requires='requires = ["present-dist>=1.0"]', run_name="ok")
    r = ftcore_cli("validate", str(plan), cwd=tmp_path, site=site)
    assert r.returncode == 0, r.stderr


# -- the example plugin package, really installed --------------------------------------------------

@pytest.fixture
def example_installed(tmp_path):
    with installed(EXAMPLE, EXAMPLE_DIST, tmp_path):
        yield


def _example_plan(folder: Path, tmp_path: Path) -> Path:
    """An example's shipped plan, moved into tmp_path so the run directory lands there."""
    quickstart = (REPO / "examples" / "quickstart").as_posix()
    text = (folder / "plan.toml").read_text()
    assert '"../quickstart/' in text
    plan = tmp_path / "plan.toml"
    plan.write_text(text.replace('"../quickstart/', f'"{quickstart}/'))
    return plan


@pytest.mark.slow
def test_example_evaluator_package_installs_lists_and_runs(tmp_path, example_installed):
    # Installed for real (pip's copy in the install folder, not the source tree nor the copy pip built from),
    # found through its entry point.
    where = subprocess.run([sys.executable, "-c", "import ftcore_example_evaluator as m; print(m.__file__)"],
                           capture_output=True, text=True, cwd="/", check=True).stdout.strip()
    assert Path(where).is_file() and tmp_path / "site" in Path(where).parents
    assert tmp_path / "pkg" not in Path(where).parents and EXAMPLE not in Path(where).parents

    listing = plugins_json(tmp_path)
    found = [c for c in listing["components"]["evaluator"] if c["name"] == "answer_length"]
    assert len(found) == 1, listing["components"]["evaluator"]
    assert found[0]["dist"] == EXAMPLE_DIST and found[0]["version"] == "0.1.0"
    assert found[0]["qualified"] == f"{EXAMPLE_DIST}:answer_length"
    assert found[0]["plugin"] == "example-evaluator"
    assert not [p for p in listing["problems"] if "example" in p]

    plan = _example_plan(EXAMPLE, tmp_path)

    r = ftcore_cli("validate", str(plan), cwd=tmp_path)
    assert r.returncode == 0, r.stderr

    r = ftcore_cli("run", str(plan), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    run_dir = tmp_path / "runs" / "example-evaluator"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    assert manifest["resolved"]["evaluate"][0]["evaluator"] == f"{EXAMPLE_DIST}:answer_length"
    for phase in ("before", "after"):
        result = json.loads((run_dir / "evaluations" / f"{phase}.json").read_text())["answer_length"]
        assert result["n"] == 32  # limit = 32 in the plan
        assert 0 <= result["mean_tokens"] <= 16  # max_new_tokens = 16
        assert 0 <= result["stop_rate"] <= 1
        assert result["mean_reference_tokens"] > 0
        answers = (run_dir / "evaluations" / phase / "answer_length" / "answers.jsonl").read_text().splitlines()
        rows = [json.loads(a) for a in answers]
        assert len(rows) == 32
        assert sum(r["tokens"] for r in rows) / 32 == pytest.approx(result["mean_tokens"])
        assert sum(r["stopped"] for r in rows) / 32 == pytest.approx(result["stop_rate"])
        assert all(r["stopped"] or r["tokens"] == 16 for r in rows)  # an answer that did not stop hit the limit


TRAINER_EXAMPLE = REPO / "examples" / "ftcore-example-trainer"


@pytest.mark.slow
def test_example_trainer_swaps_in_by_one_name_and_trains(tmp_path):
    plan = _example_plan(TRAINER_EXAMPLE, tmp_path)
    text = plan.read_text()
    builtin = tmp_path / "builtin.toml"  # the same plan with the built-in trainer: one name differs
    swapped, n = re.subn(r'(?m)^trainer = "focal_sft"', 'trainer = "sft"', text)
    swapped, m = re.subn(r'(?m)^focal_gamma = .*\n', "", swapped)  # focal_sft's own option
    assert n == m == 1
    builtin.write_text(swapped.replace('requires = ["ftcore-example-trainer>=0.2"]', ""))
    assert ftcore_cli("validate", str(builtin), cwd=tmp_path).returncode == 0
    r = ftcore_cli("validate", str(plan), cwd=tmp_path)
    assert r.returncode == 2 and "pip install 'ftcore-example-trainer>=0.2'" in r.stderr  # not installed yet

    with installed(TRAINER_EXAMPLE, "ftcore-example-trainer", tmp_path):
        listing = plugins_json(tmp_path)
        found = [c for c in listing["components"]["trainer"] if c["name"] == "focal_sft"]
        assert [c["qualified"] for c in found] == ["ftcore-example-trainer:focal_sft"]
        r = ftcore_cli("run", str(plan), cwd=tmp_path)
        assert r.returncode == 0, r.stdout + r.stderr

    run_dir = tmp_path / "runs" / "example-trainer"
    done = json.loads((run_dir / "stages" / "sft" / "COMPLETE.json").read_text())
    assert done["trainer"] == "ftcore-example-trainer:focal_sft"
    assert done["metrics"]["global_step"] == 40
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    losses = [r["loss"] for r in records if r["stage"] == "sft" and "loss" in r]
    assert len(losses) == 4 and losses[-1] < 0.6 * losses[0], losses  # logged every 10 steps
    # The runner saved what it trained, and evaluation saw the trained model.
    assert (run_dir / "stages" / "sft" / "output" / "model.safetensors").is_file()
    before = json.loads((run_dir / "evaluations" / "before.json").read_text())["perplexity"]["perplexity"]
    after = json.loads((run_dir / "evaluations" / "after.json").read_text())["perplexity"]["perplexity"]
    assert after < before / 2, (before, after)


def test_a_distribution_whose_metadata_has_no_name_does_not_break_commands(tmp_path):
    """A dist-info whose METADATA is empty (pip writing it beside a running command, or a broken install)
    declares an entry point of no named distribution: its plugin loads under "?", and commands run."""
    site = tmp_path / "site"
    add_dist(site, "half-written", {"half_written": component_module("register_evaluators", "Half", "half",
                                                                     "evaluate")}, {"half": "half_written"})
    (site / "half_written-1.0.dist-info" / "METADATA").write_text("")
    r = ftcore_cli("plugins", cwd=tmp_path, site=site)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "half" in r.stdout
