"""Meta-tests, in the spirit of datasette's: every hook is documented and exercised,
every built-in component and option is in the plan reference."""

from __future__ import annotations

import inspect
import re

import pytest

from conftest import ROOT

from ftcore import hookspecs
from ftcore.component import KINDS
from ftcore.plugins import BUILTIN_PLUGINS, get_plugin_manager

HOOKS = [name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
         if hasattr(fn, "ftcore_spec")]
DOCS = (ROOT / "docs" / "writing-plugins.md").read_text() + (ROOT / "docs" / "architecture.md").read_text()
REFERENCE = (ROOT / "docs" / "plan-reference.md").read_text()
TESTS = "".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py") if p.name != "test_meta.py")


def test_there_is_a_registry_hook_per_kind_and_lifecycle_hooks():
    assert {k.hook for k in KINDS.values()} <= set(HOOKS)
    assert {"ftcore_run_start", "ftcore_stage_start", "ftcore_stage_end", "ftcore_log",
            "ftcore_run_end"} <= set(HOOKS)


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_typed_and_has_param_docs(hook):
    fn = getattr(hookspecs, hook)
    sig = inspect.signature(fn)
    for name in sig.parameters:
        assert f":param {name}:" in (fn.__doc__ or ""), f"{hook} does not document {name}"
        assert sig.parameters[name].annotation is not inspect.Parameter.empty


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_documented(hook):
    assert hook in DOCS, f"{hook} is not in docs/writing-plugins.md or docs/architecture.md"


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_exercised_by_a_test(hook):
    # Registry hooks are exercised by every run; lifecycle hooks need a test implementing them.
    assert re.search(rf"\b{hook}\b", TESTS), f"no test implements or names {hook}"


def test_every_builtin_plugin_registers_something_and_is_a_module_per_component():
    pm = get_plugin_manager(entry_points=False)
    registry = pm.registry()
    assert not registry.problems
    by_plugin: dict[str, int] = {}
    for kind in KINDS:
        for reg in registry.all(kind):
            by_plugin[reg.plugin] = by_plugin.get(reg.plugin, 0) + 1
    for regs in registry.sections.values():  # or a plan table its kind owns ([distributed])
        for reg in regs:
            if reg.plugin in BUILTIN_PLUGINS:
                by_plugin[reg.plugin] = by_plugin.get(reg.plugin, 0) + 1
    for impl in pm.hook.ftcore_preflight.get_hookimpls():  # or the pre-flight checks of a run (models/)
        by_plugin[impl.plugin_name] = by_plugin.get(impl.plugin_name, 0) + 1
    assert by_plugin == {name: 1 for name in BUILTIN_PLUGINS}


def test_every_builtin_component_and_option_is_in_the_plan_reference():
    registry = get_plugin_manager(entry_points=False).registry()
    for kind in KINDS:
        for reg in registry.all(kind):
            assert f"`{reg.name}`" in REFERENCE or f'"{reg.name}"' in REFERENCE, reg.name
            for option in reg.cls.Options.model_fields:
                assert f"`{option}`" in REFERENCE, f"{kind} '{reg.name}' option '{option}' is undocumented"


# -- the README: a page read in five minutes; the reference lives in docs/ -------------------------

README = (ROOT / "README.md").read_text()
DOCS_ALL = "".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))


def test_the_readme_is_short_and_gives_both_commands_first():
    assert len(README) < 10_000, f"README.md has {len(README)} characters: move reference material to docs/"
    blocks = [b.strip() for b in re.findall(r"```\w*\n(.*?)```", README, re.S)]
    quickstart, tests = blocks[:2]
    assert quickstart.startswith("python3 -m venv .venv") and quickstart.endswith(
        "ftcore run examples/quickstart/plan.toml")
    assert tests.startswith("python3 -m venv .venv") and tests.endswith("python -m pytest -q -n 2")
    # .ci/run runs exactly the README's test command.
    assert tests.rpartition(" && ")[2] in (ROOT / ".ci" / "run").read_text().splitlines()


def test_every_command_is_in_the_readme_and_in_docs():
    from ftcore.command import commands as collect_commands

    commands, problems = collect_commands(get_plugin_manager(entry_points=False))
    assert not problems
    for name in ["run", "validate", "plugins", *commands]:
        assert f"`ftcore {name}" in README, f"ftcore {name} is not in the README's table of commands"
        assert f"ftcore {name}" in DOCS_ALL, f"ftcore {name} is described nowhere in docs/"


def test_the_readme_links_every_doc():
    unlinked = [d.name for d in sorted((ROOT / "docs").glob("*.md")) if f"](docs/{d.name}" not in README]
    assert not unlinked, f"README.md's Documentation list lacks {unlinked}"


# -- the layout by kind ----------------------------------------------------------------------------

def _imports(path):
    """Every ``ftcore_plugins.<folder>`` a module imports, at module level or inside functions."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
        found |= {n.split(".")[1] for n in names if n.startswith("ftcore_plugins.") and n.count(".") >= 1}
    return found


def test_no_kind_imports_another_kinds_folder_only_common():
    plugins = ROOT / "plugins"
    crossing = []
    for path in sorted(plugins.glob("*/*.py")):
        folder = path.parent.name
        allowed = {folder} if folder == "common" else {folder, "common"}
        crossing += [f"{path.relative_to(ROOT)} imports ftcore_plugins.{other}" for other in _imports(path) - allowed]
    assert not crossing, "\n".join(crossing)
    assert not list(plugins.glob("*.py"))[1:], "plugins/ holds folders (and __init__.py) only"


def test_every_plugin_folder_is_a_package_the_distribution_ships():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    packages = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {f"ftcore_plugins.{d.name}" for d in (ROOT / "plugins").iterdir()
               if d.is_dir() and d.name != "__pycache__"}
    assert all((ROOT / "plugins" / f.split(".")[1] / "__init__.py").exists() for f in folders)
    assert folders <= packages, folders - packages


def test_builtin_modules_live_in_their_kinds_folder():
    folder_of_kind = {"model loader": "models", "data source": "data", "chat template": "templates",
                      "adapter": "adapters", "quantizer": "quantizers", "trainer": "trainers",
                      "evaluator": "evaluators", "exporter": "exporters", "reward function": "rewards",
                      "tracker": "trackers"}
    registry = get_plugin_manager(entry_points=False).registry()
    misplaced = [f"{r.kind} '{r.name}' in {r.plugin}" for kind in KINDS for r in registry.all(kind)
                 if r.plugin.split(".")[1] != folder_of_kind[kind]]
    assert not misplaced, misplaced


# -- numeric options have bounds -------------------------------------------------------------------

# Options whose every finite value means something; each other numeric option needs a lower bound.
UNBOUNDED = {"reward function:regex.match", "reward function:regex.miss"}
CHECKED_BY_A_VALIDATOR = {"validation"}  # a share in (0, 1) or a row count >= 1 (data sources' shared options)


def _numeric_options() -> list[tuple[str, object]]:
    import typing

    found = []
    registry = get_plugin_manager().registry()
    for kind in KINDS:
        for reg in registry.all(kind):
            if not reg.dist.startswith("ftcore"):
                continue
            for field, info in reg.cls.Options.model_fields.items():
                annotation = info.annotation
                inner = [annotation, *typing.get_args(annotation)]
                if any(t in (int, float) for t in inner):
                    found.append((f"{kind}:{reg.name}.{field}", info))
    return found


def test_every_numeric_option_of_a_builtin_has_a_lower_bound():
    import annotated_types

    options = _numeric_options()
    assert len(options) > 100
    missing = [key for key, info in options
               if key not in UNBOUNDED and key.rpartition(".")[2] not in CHECKED_BY_A_VALIDATOR
               and not any(isinstance(m, (annotated_types.Ge, annotated_types.Gt)) for m in info.metadata)]
    assert missing == []


def test_no_option_takes_inf_or_nan():
    import typing

    from pydantic import ValidationError

    registry = get_plugin_manager().registry()
    floats = [(key, info) for key, info in _numeric_options()
              if float in (info.annotation, *typing.get_args(info.annotation))]
    assert floats
    for key, _ in floats:
        kind, _, rest = key.partition(":")
        name, _, field = rest.rpartition(".")
        options = registry.resolve(kind, name).cls.Options
        for bad in (float("inf"), float("-inf"), float("nan")):
            with pytest.raises(ValidationError, match="finite number"):
                options.model_validate({field: bad}, context={"base_dir": ROOT})


# -- the kernel ------------------------------------------------------------------------------------

KERNEL = ROOT / "ftcore"
# The plugin authors' kit builds tiny models (torch, the built-in scratch loader): it is not the kernel.
NOT_KERNEL = {"testing.py"}


def _kernel_imports(path):
    """``(ftcore modules, other top-level packages)`` a kernel module imports, at module level or inside
    functions; imports under ``if TYPE_CHECKING:`` are for annotations and not counted."""
    import ast

    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {id(n) for node in ast.walk(tree)
                   if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    modules = {p.stem for p in KERNEL.glob("*.py")}
    inside, outside = set(), set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.level:
            inside |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module == "ftcore":
            inside |= {a.name for a in node.names}
        else:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) else []
            inside |= {n.split(".")[1] for n in names if n.startswith("ftcore.")}
            outside |= {n.split(".")[0] for n in names if not n.startswith("ftcore.") and n != "ftcore"}
    return (inside & modules) - {path.stem}, outside


def test_the_kernel_imports_no_torch_transformers_or_plugin():
    heavy = {"torch", "transformers", "trl", "peft", "datasets", "accelerate", "deepspeed", "ftcore_plugins"}
    found = {f"{p.name} imports {', '.join(sorted(_kernel_imports(p)[1] & heavy))}"
             for p in sorted(KERNEL.glob("*.py")) if p.name not in NOT_KERNEL and _kernel_imports(p)[1] & heavy}
    assert not found, sorted(found)


def test_the_kernel_has_no_import_circle():
    graph = {p.stem: _kernel_imports(p)[0] for p in KERNEL.glob("*.py")}
    circles = []

    def visit(module, path):
        for target in sorted(graph.get(module, ())):
            if target in path:
                circles.append(" -> ".join([*path[path.index(target):], target]))
            elif target not in done:
                visit(target, [*path, target])
        done.add(module)

    done: set[str] = set()
    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    assert not circles, circles



KERNEL_LINES = 3_000  # issue #32: the kernel holds the kernel; features go to plugins/, reached through hooks


def test_the_kernel_stays_under_its_line_budget():
    sizes = {p.name: len(p.read_text(encoding="utf-8").splitlines())
             for p in sorted(KERNEL.glob("*.py")) if p.name not in NOT_KERNEL}
    total = sum(sizes.values())
    biggest = ", ".join(f"{name} {n}" for name, n in sorted(sizes.items(), key=lambda kv: -kv[1])[:4])
    assert total <= KERNEL_LINES, (f"ftcore/ (without {', '.join(sorted(NOT_KERNEL))}) has {total} lines, over "
                                   f"{KERNEL_LINES:,} ({biggest}, ...): move a feature into plugins/ behind a hook")


def test_every_cuda_only_test_carries_the_gpu_marker():
    """``pytest -m gpu`` (what benchmarks/gpu_smoke.py runs on a lent GPU) reaches every test that skips without
    CUDA: each test skipped on ``not torch.cuda.is_available()`` is marked ``gpu``, and the smoke check finds
    the files that have such tests."""
    import ast

    unmarked, marked = [], 0
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test"):
                continue
            decorators = [ast.unparse(d) for d in node.decorator_list]
            cuda_only = any(d.startswith("pytest.mark.skipif(not torch.cuda.is_available()") for d in decorators)
            gpu = "pytest.mark.gpu" in decorators
            marked += gpu
            if cuda_only and not gpu:
                unmarked.append(f"{path.name}::{node.name}")
    assert not unmarked, f"CUDA-only tests without @pytest.mark.gpu: {unmarked}"
    assert marked >= 2
