"""Malformed plans, through the real CLI: each problem is one actionable line.

Every case builds a small valid plan in ``tmp_path`` (a scratch model whose tokenizer
trains on the plan's own data, one jsonl file, one sft stage), breaks it in one way, and
runs ``python -m ftcore validate`` (and ``run`` for a few) in a subprocess. Each must:

* exit with status 2 and print no traceback;
* print every problem on one line of stderr, starting with the plan path exactly as it
  was given on the command line, then ``:``;
* name the key path of the problem (``stage[0].trainer``, ``data.train.path``, ...);
* leave the disk untouched: no run directory, no file created, changed or removed.

Third-party plugins are switched off (``FTCORE_LOAD_PLUGINS=""``) so that whatever else
is installed cannot add components, warnings or imports to what is checked here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ENV = {**os.environ, "FTCORE_LOAD_PLUGINS": ""}

ROWS = [
    {"messages": [{"role": "user", "content": "Which is an animal? red cat tree"},
                  {"role": "assistant", "content": "the cat"}]},
    {"messages": [{"role": "user", "content": "Which is an animal? dog stone blue"},
                  {"role": "assistant", "content": "the dog"}]},
]

BASE = """\
[run]
name = "tiny"
seed = 1
output_dir = "runs"

[model]
use = "scratch"
hidden_size = 32
num_layers = 1
num_heads = 2
tokenizer_data = ["train"]
vocab_size = 300

[template]
use = "chatml"

[data.train]
use = "jsonl"
path = "train.jsonl"

[[stage]]
name = "sft"
trainer = "sft"
data = "train"
adapter = { use = "lora", r = 8 }
epochs = 1
learning_rate = 1e-3
"""

EVALUATE = """
[[evaluate]]
use = "perplexity"
data = "train"
"""


# -- helpers ---------------------------------------------------------------------------------

def sub(old: str, new: str) -> Callable[[str], str]:
    """A mutation replacing ``old`` (which must occur exactly once in the plan) by ``new``."""

    def mutate(text: str) -> str:
        assert text.count(old) == 1, f"the base plan has {text.count(old)} of {old!r}"
        return text.replace(old, new)

    return mutate


def prepend(extra: str) -> Callable[[str], str]:
    return lambda text: extra + text


def append(extra: str) -> Callable[[str], str]:
    return lambda text: text + extra


def without_stage(text: str) -> str:
    return text[: text.index("[[stage]]")]


def write_project(folder: Path, plan_text: str = BASE) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")
    plan = folder / "plan.toml"
    plan.write_text(plan_text, encoding="utf-8")
    return plan


def ftcore(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ftcore", *args], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=3600)  # only catches a hang


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``folder`` (files and folders) with its mtime and size."""
    out = {}
    for p in sorted(folder.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(folder))] = (st.st_mtime_ns, st.st_size if p.is_file() else -1)
    return out


def problem_lines(result: subprocess.CompletedProcess, shown: str) -> list[str]:
    """Check the shape every failure shares, and return stderr's lines."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stdout == "", result.stdout
    lines = result.stderr.splitlines()
    assert lines, "no message at all"
    for line in lines:
        assert line.startswith(f"{shown}:"), f"does not start with {shown!r}: {line!r}"
    return lines


def check_line(line: str, plan: Path, key: str | None, fragments: list[str]) -> None:
    if key is not None:
        assert line.startswith(f"{plan}: {key}: "), line
    for fragment in fragments:
        fragment = fragment.format(tmp=plan.parent.resolve())
        assert fragment in line, (fragment, line)


# -- one problem each ------------------------------------------------------------------------

# (id, mutation, key path as it must appear, further fragments the line must hold; "{tmp}" is
# the project folder)
CASES = [
    ("toml-syntax", sub("seed = 1", "seed = = 1"), None, ["plan.toml:3:", "invalid TOML"]),
    ("unknown-trainer", sub('trainer = "sft"', 'trainer = "sfft"'), "stage[0].trainer",
     ["unknown trainer 'sfft'", "did you mean 'sft'?"]),
    ("unknown-model-loader", sub('use = "scratch"', 'use = "scrach"'), "model.use",
     ["unknown model loader 'scrach'", "did you mean 'scratch'?"]),
    ("unknown-trainer-option", sub("learning_rate =", "learning_rat ="), "stage[0].learning_rat",
     ["unknown key for trainer 'sft'", "did you mean 'learning_rate'?"]),
    ("unknown-adapter-option", sub("r = 8", "r = 8, lora_alhpa = 16"), "stage[0].adapter.lora_alhpa",
     ["unknown key for adapter 'lora'", "did you mean 'lora_alpha'?"]),
    ("unknown-top-level-key", prepend("stages = 1\n"), "stages",
     ["unknown top-level key", "did you mean 'stage'?"]),
    ("unknown-run-key", sub("seed = 1", "sed = 1"), "run.sed", ["unknown key", "did you mean 'seed'?"]),
    ("wrong-type-epochs", sub("epochs = 1", 'epochs = "two"'), "stage[0].epochs", ["valid number", "'two'"]),
    ("wrong-type-lora-r", sub("r = 8", 'r = "8"'), "stage[0].adapter.r", ["valid integer", "'8'"]),
    ("wrong-type-bool", sub("r = 8", 'r = 8, use_rslora = "yes"'), "stage[0].adapter.use_rslora",
     ["valid boolean", "'yes'"]),
    ("wrong-type-run-seed", sub("seed = 1", 'seed = "1"'), "run.seed", ["must be int", "string"]),
    ("wrong-type-union", sub("r = 8", "r = 8, target_modules = 3"), "stage[0].adapter.target_modules",
     ["'all-linear'"]),
    ("wrong-type-list-item", sub('tokenizer_data = ["train"]', "tokenizer_data = [1]"),
     "model.tokenizer_data[0]", ["valid string"]),
    ("missing-data-file", sub('path = "train.jsonl"', 'path = "data/missing.jsonl"'), "data.train.path",
     ["no such file or folder: {tmp}/data/missing.jsonl", "'data/missing.jsonl'"]),
    ("data-without-path", sub('path = "train.jsonl"\n', ""), "data.train.path", ["missing required key"]),
    ("stage-without-trainer", sub('trainer = "sft"\n', ""), "stage[0].trainer", ["missing required key"]),
    ("no-model-table", lambda t: t[: t.index("[model]")] + t[t.index("[template]"):], "model",
     ["missing required table [model]"]),
    ("stage-undefined-data", sub('data = "train"', 'data = "trian"'), "stage[0].data",
     ["undefined data 'trian'", "did you mean 'train'?", "[data.trian]"]),
    ("evaluate-undefined-data", append(EVALUATE.replace('"train"', '"held_out"')), "evaluate[0].data",
     ["undefined data 'held_out'", "[data.held_out]"]),
    ("bad-when", append(EVALUATE + 'when = "during"\n'), "evaluate[0].when",
     ["unknown phase 'during'", "after, before, both, sft"]),
    ("duplicate-stage-names", append('\n[[stage]]\nname = "sft"\ntrainer = "sft"\ndata = "train"\n'),
     "stage[1].name", ["duplicate stage name 'sft'"]),
    ("duplicate-evaluation-names", append(EVALUATE + EVALUATE), "evaluate[1].name",
     ["duplicate evaluation name 'perplexity'"]),
    ("stage-not-a-table", lambda t: 'stage = "sft"\n' + without_stage(t), "stage",
     ["must be an array of tables ([[stage]])", "a string"]),
    ("stage-adapter-not-a-table", sub('adapter = { use = "lora", r = 8 }', "adapter = 8"), "stage[0].adapter",
     ["must be a table or a name"]),
    ("quantizer-not-a-table", prepend("quantizer = 4\n"), "quantizer", ["must be a table or a name"]),
    ("requires-not-installed", prepend('requires = ["ftcore-no-such-package>=1.0"]\n'), "requires[0]",
     ["ftcore-no-such-package is not installed", "pip install 'ftcore-no-such-package>=1.0'"]),
    ("requires-too-old", prepend('requires = ["pydantic>=999"]\n'), "requires[0]",
     ["is installed but the plan needs 'pydantic>=999'"]),
    ("requires-invalid", prepend('requires = ["torch >>= 2"]\n'), "requires[0]",
     ["not a valid requirement 'torch >>= 2'"]),
    ("adapter-export-after-full-fine-tune",
     lambda t: sub('adapter = { use = "lora", r = 8 }', 'adapter = "full"')(t) + '\n[[export]]\nuse = "adapter"\n',
     "export[0]", ["needs the last stage to train a peft adapter", "'full'", 'use = "merged"']),
    ("export-name-not-a-folder", append('\n[[export]]\nuse = "merged"\nname = "../out"\n'), "export[0].name",
     ["'../out' is not a usable folder name"]),
    ("unusable-run-name", sub('name = "tiny"', 'name = "../escape"'), "run.name",
     ["'../escape' is not a usable folder name"]),
    ("unusable-output-dir", sub('output_dir = "runs"', 'output_dir = "~ftcore-no-such-user/runs"'),
     "run.output_dir", ["cannot expand"]),
    ("scratch-without-tokenizer", sub('tokenizer_data = ["train"]\n', ""), "model",
     ["set exactly one of 'tokenizer'", "'tokenizer_data'"]),
    ("scratch-tokenizer-data-undefined", sub('tokenizer_data = ["train"]', 'tokenizer_data = ["corpus"]'),
     "model.tokenizer_data[0]", ["undefined data 'corpus'"]),
]


def test_the_base_plan_is_valid(tmp_path):
    plan = write_project(tmp_path)
    result = ftcore("validate", str(plan))
    assert result.returncode == 0, result.stderr
    assert f"{plan}: OK:" in result.stdout
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("mutate, key, fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_validate_reports_one_line(tmp_path, mutate, key, fragments):
    plan = write_project(tmp_path, mutate(BASE))
    before = snapshot(tmp_path)
    result = ftcore("validate", str(plan))
    lines = problem_lines(result, str(plan))
    assert len(lines) == 1, lines
    check_line(lines[0], plan, key, fragments)
    assert snapshot(tmp_path) == before


RUN_CASES = ["toml-syntax", "unknown-trainer", "missing-data-file", "adapter-export-after-full-fine-tune",
             "requires-not-installed"]


@pytest.mark.parametrize("case", RUN_CASES)
def test_run_fails_before_creating_anything(tmp_path, case):
    _, mutate, key, fragments = next(c for c in CASES if c[0] == case)
    plan = write_project(tmp_path, mutate(BASE))
    before = snapshot(tmp_path)
    result = ftcore("run", str(plan))
    lines = problem_lines(result, str(plan))
    assert len(lines) == 1, lines
    check_line(lines[0], plan, key, fragments)
    assert not (tmp_path / "runs").exists()
    assert snapshot(tmp_path) == before


def test_the_path_is_shown_as_given(tmp_path):
    """A relative path on the command line is repeated as is, with the line of a TOML error."""
    write_project(tmp_path, BASE.replace("seed = 1", "seed = = 1"))
    before = snapshot(tmp_path)
    lines = problem_lines(ftcore("validate", "plan.toml", cwd=tmp_path), "plan.toml")
    assert len(lines) == 1 and lines[0].startswith("plan.toml:3: invalid TOML"), lines
    assert snapshot(tmp_path) == before


# -- the plan file itself --------------------------------------------------------------------

def test_missing_plan_file(tmp_path):
    write_project(tmp_path)
    missing = tmp_path / "nope" / "plan.toml"
    before = snapshot(tmp_path)
    for command in ("validate", "run"):
        lines = problem_lines(ftcore(command, str(missing)), str(missing))
        assert lines == [f"{missing}: no such plan file"]
    assert snapshot(tmp_path) == before


def test_plan_file_not_utf8(tmp_path):
    plan = write_project(tmp_path)
    plan.write_bytes(BASE.replace('"tiny"', '"caf\xe9"').encode("latin-1"))
    before = snapshot(tmp_path)
    line = next(i for i, text in enumerate(BASE.splitlines(), 1) if '"tiny"' in text)
    column = BASE.splitlines()[line - 1].index('"tiny"') + 5  # the é, after `"caf`
    for command in ("validate", "run"):
        lines = problem_lines(ftcore(command, str(plan)), str(plan))
        assert lines == [f"{plan}:{line}: not UTF-8 text at column {column} (byte 0xe9); save the plan as UTF-8"]
    assert snapshot(tmp_path) == before


def test_plan_file_with_a_byte_order_mark_is_read(tmp_path):
    plan = write_project(tmp_path)
    plan.write_bytes(b"\xef\xbb\xbf" + BASE.encode())
    r = ftcore("validate", str(plan))
    assert r.returncode == 0, r.stderr
    # and a position after the BOM is still counted from the first character
    plan.write_bytes(b"\xef\xbb\xbf" + BASE.replace('"tiny"', '"caf\xe9"').encode("latin-1"))
    line = next(i for i, text in enumerate(BASE.splitlines(), 1) if '"tiny"' in text)
    column = BASE.splitlines()[line - 1].index('"tiny"') + 5
    assert problem_lines(ftcore("validate", str(plan)), str(plan)) == \
        [f"{plan}:{line}: not UTF-8 text at column {column} (byte 0xe9); save the plan as UTF-8"]


# -- all at once, and --debug ----------------------------------------------------------------

def test_several_problems_are_reported_together(tmp_path):
    text = BASE
    for mutate in (sub("seed = 1", "sed = 1"),
                   sub("hidden_size = 32", 'hidden_size = "32"'),
                   sub('path = "train.jsonl"', 'path = "missing.jsonl"'),
                   sub('data = "train"', 'data = "trian"'),
                   sub("epochs = 1", 'epochs = "two"'),
                   sub("r = 8", "rank = 8"),
                   append(EVALUATE + 'when = "later"\n'),
                   prepend("stages = 1\n")):
        text = mutate(text)
    plan = write_project(tmp_path, text)
    before = snapshot(tmp_path)
    lines = problem_lines(ftcore("validate", str(plan)), str(plan))
    keys = ["stages", "run.sed", "model.hidden_size", "data.train.path", "stage[0].data", "stage[0].epochs",
            "stage[0].adapter.rank", "evaluate[0].when"]
    for key in keys:
        assert sum(line.startswith(f"{plan}: {key}: ") for line in lines) == 1, (key, lines)
    assert len(lines) == len(keys), lines
    assert snapshot(tmp_path) == before


def test_debug_shows_the_traceback(tmp_path):
    plan = write_project(tmp_path, BASE.replace('trainer = "sft"', 'trainer = "sfft"'))
    before = snapshot(tmp_path)
    for args in (("validate", "--debug", str(plan)), ("--debug", "validate", str(plan)),
                 ("--debug", "run", str(plan))):  # the flag after the command, or before it as --help shows
        result = ftcore(*args)
        assert result.returncode == 2
        assert f"{plan}: stage[0].trainer: unknown trainer 'sfft'" in result.stderr
        assert "Traceback" in result.stderr and "PlanError" in result.stderr, args
    assert snapshot(tmp_path) == before


# -- what the light commands import ----------------------------------------------------------

IMPORTS = """
import json, sys
from ftcore.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "heavy": sorted(m for m in ("torch", "transformers") if m in sys.modules)}))
"""


@pytest.mark.parametrize("args, code", [
    (["validate", "GOOD"], 0), (["validate", "BAD"], 2), (["plugins"], 0), (["plugins", "--json"], 0), (["--help"], 0),
], ids=["validate-ok", "validate-bad", "plugins", "plugins-json", "help"])
def test_light_commands_do_not_import_torch_or_transformers(tmp_path, args, code):
    plans = {"GOOD": write_project(tmp_path / "good"),
             "BAD": write_project(tmp_path / "bad", BASE.replace('trainer = "sft"', 'trainer = "sfft"'))}
    args = [str(plans.get(a, a)) for a in args]
    result = subprocess.run([sys.executable, "-c", IMPORTS, *args], env=ENV, capture_output=True, text=True,
                            timeout=3600)  # only catches a hang
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["code"] == code, result.stderr
    assert report["heavy"] == [], report
