"""Test helpers for ftcore plugins: tiny models, tiny plans and a runner for the real CLI.

Installed with ftcore as a pytest plugin (entry point ``pytest11``), so its fixtures are there in
any test of a project that has ftcore installed; ``pytest_plugins = ["ftcore.testing"]`` in a
``conftest.py`` does the same where entry-point plugins are turned off (``-p no:ftcore``,
``PYTEST_DISABLE_PLUGIN_AUTOLOAD``). Nothing is downloaded: models are built from a config and
the tokenizer is trained on the tiny data, as the ``scratch`` model loader does.

Fixtures (none is autouse; each keeps ftcore's cache of tokenized data in a temporary folder):

- ``ftcore_plan(overrides=None, toml="", name="plan.toml")`` writes a plan, with tiny data next
  to it, into the test's ``tmp_path``: :func:`write_plan`.
- ``ftcore_run("run", plan, ...)`` runs the CLI and returns a :class:`RunResult` (exit code,
  stdout, stderr, run folder, metrics records, summary): :func:`run_ftcore`.
- ``ftcore_tiny_model`` a fresh :class:`TinyModel` (model, tokenizer, chat template) per test.
- ``ftcore_stage(rows=None, eval_rows=None, stage="sft")`` a ``StageContext`` on a fresh tiny
  model, to call a trainer's ``train(ctx)`` directly; ``ctx.reporter`` is a
  :class:`RecordingReporter`.

This module imports neither torch nor transformers at import time (the fixtures do, when used),
so registering it costs a pytest session nothing.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import pytest

__all__ = ["ANIMALS", "OTHERS", "TINY_PLAN", "RecordingReporter", "RunResult", "TinyModel", "chat_rows", "complete_checkpoints",
           "run_ftcore", "stage_context", "start_ftcore", "text_rows", "tiny_model", "to_toml", "wait_until",
           "write_jsonl", "write_plan"]

# -- tiny data -------------------------------------------------------------------------------------
ANIMALS = ["cat", "dog", "bird", "fox"]
OTHERS = ["red", "blue", "tree", "stone", "runs", "sees"]


def chat_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` chat rows of a task a tiny model learns in a few dozen steps:
    "Which is an animal? red cat tree" -> "the cat"."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        animal = rng.choice(ANIMALS)
        words = [animal, *rng.sample(OTHERS, 2)]
        rng.shuffle(words)
        rows.append({"messages": [{"role": "user", "content": "Which is an animal? " + " ".join(words)},
                                  {"role": "assistant", "content": f"the {animal}"}]})
    return rows


def text_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` plain-text rows (``{"text": ...}``) over the same words, for ``pretrain``."""
    rng = random.Random(seed)
    return [{"text": " ".join(f"the {rng.choice(OTHERS)} {rng.choice(ANIMALS)} {rng.choice(OTHERS)}."
                              for _ in range(4))} for _ in range(n)]


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> Path:
    path = Path(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# -- plans -------------------------------------------------------------------------------------------
# A plan that trains in a few seconds on a CPU: a 2-layer, hidden-64 Llama from scratch with a BPE
# tokenizer trained on the plan's data, and one short sft stage with a checkpoint every 4 steps.
TINY_PLAN: dict[str, Any] = {
    "run": {"name": "tiny", "seed": 7},
    "model": {"use": "scratch", "hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 128,
              "max_position_embeddings": 128, "tokenizer_data": ["chat", "text"], "vocab_size": 300},
    "template": {"use": "chatml"},
    "data": {"chat": {"use": "jsonl", "path": "chat.jsonl"},
             "chat_eval": {"use": "jsonl", "path": "chat_eval.jsonl"},
             "text": {"use": "jsonl", "path": "text.jsonl"}},
    "stage": [{"name": "sft", "trainer": "sft", "data": "chat", "adapter": "full", "max_steps": 8,
               "batch_size": 4, "max_length": 64, "learning_rate": 3e-3, "logging_steps": 1, "save_steps": 4}],
}
_TINY_DATA = {"chat.jsonl": lambda: chat_rows(64), "chat_eval.jsonl": lambda: chat_rows(16, seed=1),
              "text.jsonl": lambda: text_rows(64)}


def _merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Tables merge key by key; any other value (a list of stages too) replaces; None removes the key."""
    out = dict(base)
    for key, value in overrides.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (str, Path)):
        return json.dumps(str(value))  # a JSON string is a valid TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {type(value).__name__} to TOML: {value!r}")


def _toml_key(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() else json.dumps(key)


def to_toml(plan: dict[str, Any]) -> str:
    """A plan dict as TOML: tables as ``[a.b]`` sections, lists of tables (``stage``, ``evaluate``,
    ``export``) as ``[[...]]`` sections, tables inside those inline. Checked by parsing it back."""
    import tomllib

    def is_table_list(v: Any) -> bool:
        return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)

    def section(header: str, table: dict[str, Any], in_array: bool) -> list[str]:
        """The section's lines, then its sub-sections right after it (so they attach to it)."""
        lines: list[str] = []
        subsections = []
        for k, v in table.items():
            name = f"{header.strip('[]')}.{_toml_key(k)}" if header else _toml_key(k)
            if isinstance(v, dict) and not in_array:
                subsections.append((f"[{name}]", v, False))
            elif is_table_list(v) and not in_array:
                subsections += [(f"[[{name}]]", item, True) for item in v]
            else:
                lines.append(f"{_toml_key(k)} = {_toml_value(v)}")
        if header and (lines or in_array or not subsections):  # [data] holding only [data.x] needs no header
            lines.insert(0, header)
        for sub in subsections:
            body = section(*sub)
            lines += body if body[:1] == [""] else ["", *body]
        return lines

    text = "\n".join(section("", plan, False)).lstrip("\n") + "\n"
    if tomllib.loads(text) != json.loads(json.dumps(plan, default=str)):
        raise ValueError("to_toml: the plan does not survive a round trip through TOML")
    return text


def write_plan(folder: Path, overrides: dict[str, Any] | None = None, toml: str = "", *,
               name: str = "plan.toml", data: bool = True) -> Path:
    """Write ``TINY_PLAN`` merged with ``overrides`` (tables merge, lists replace, None removes), then
    the ``toml`` text, to ``folder/name``; with ``data``, also the tiny data files it names
    (``chat.jsonl``: 64 chat rows, ``chat_eval.jsonl``: 16, ``text.jsonl``: 64 text rows) where
    they do not exist yet. Returns the plan's path; the run folder is ``folder/runs/<run.name>``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if data:
        for file, rows in _TINY_DATA.items():
            if not (folder / file).exists():
                write_jsonl(folder / file, rows())
    path = folder / name
    path.write_text(to_toml(_merge(TINY_PLAN, overrides or {})) + ("\n" + toml if toml else ""), encoding="utf-8")
    return path


# -- running the CLI ---------------------------------------------------------------------------------
@dataclass
class RunResult:
    """What an ``ftcore`` command left: its exit code and output, and for ``run`` the run folder."""

    exit_code: int
    stdout: str
    stderr: str
    run_dir: Path | None = None

    def _json(self, name: str) -> Any:
        path = self.run_dir / name if self.run_dir else None
        return json.loads(path.read_text()) if path and path.exists() else None

    @property
    def metrics(self) -> list[dict[str, Any]]:
        """Every record of ``metrics.jsonl`` (``stage``, ``step``, the values), oldest first."""
        path = self.run_dir / "metrics.jsonl" if self.run_dir else None
        if not path or not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    @property
    def summary(self) -> dict[str, Any] | None:
        """``summary.json``: written when the run completes."""
        return self._json("summary.json")

    @property
    def manifest(self) -> dict[str, Any] | None:
        """``manifest.json``: ``status`` is running, complete, failed or interrupted."""
        return self._json("manifest.json")

    def losses(self, stage: str, key: str = "loss") -> dict[int, float]:
        """The stage's logged ``key`` by step (a resumed run's records of redone steps: the last wins)."""
        return {r["step"]: r[key] for r in self.metrics if r.get("stage") == stage and key in r}

    def stage_metrics(self, stage: str) -> dict[str, Any] | None:
        """The final metrics of a completed stage, from its ``COMPLETE.json``; None while unfinished."""
        done = self._json(f"stages/{stage}/COMPLETE.json")
        return done["metrics"] if done else None

    def check(self) -> RunResult:
        """Fail the test with the command's output unless it exited 0; returns self."""
        if self.exit_code != 0:
            pytest.fail(f"ftcore exited {self.exit_code}\n--- stdout\n{self.stdout[-4000:]}\n"
                        f"--- stderr\n{self.stderr[-4000:]}", pytrace=False)
        return self


def _run_dir(args: tuple[str, ...], cwd: Path | None) -> Path | None:
    """The run folder of ``ftcore run PLAN``, as ftcore.plan resolves it (run.name, run.output_dir)."""
    import tomllib

    if len(args) < 2 or args[0] != "run":
        return None
    plan = Path(cwd or ".", args[1])
    try:
        run = tomllib.loads(plan.read_text(encoding="utf-8")).get("run", {})
    except (OSError, ValueError):
        return None
    return (plan.parent / run.get("output_dir", "runs") / run.get("name", plan.stem)).resolve()


def run_ftcore(*args: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None,
               in_process: bool = False, timeout: float = 3600) -> RunResult:
    """Run ``ftcore ARGS`` and return a :class:`RunResult`: in a subprocess (``python -m ftcore``,
    as a user would; ``env`` adds to the environment), or with ``in_process`` through
    ``ftcore.cli.main`` in this interpreter (faster; output captured; ``env`` set for the call).
    The timeout only catches a hang."""
    args = tuple(str(a) for a in args)
    if not in_process:
        r = subprocess.run([sys.executable, "-m", "ftcore", *args], cwd=cwd, env={**os.environ, **(env or {})},
                           capture_output=True, text=True, timeout=timeout)
        return RunResult(r.returncode, r.stdout, r.stderr, _run_dir(args, cwd))
    from ftcore.cli import main

    out, err = io.StringIO(), io.StringIO()
    saved_env = {k: os.environ.get(k) for k in (env or {})}
    cwd_before = os.getcwd()
    try:
        os.environ.update(env or {})
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
    finally:
        os.chdir(cwd_before)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return RunResult(code, out.getvalue(), err.getvalue(), _run_dir(args, cwd))


def start_ftcore(*args: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``python -m ftcore ARGS`` without waiting (to signal or kill it); pipes for its output."""
    return subprocess.Popen([sys.executable, "-m", "ftcore", *map(str, args)], cwd=cwd,
                            env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def wait_until(proc: subprocess.Popen, ready: Callable[[], Any], timeout: float = 3600) -> None:
    """Poll ``ready()`` until it is true; fail the test if ``proc`` ends first (or on a hang)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if ready():
            return
        time.sleep(0.02)
    out, err = proc.communicate()
    pytest.fail(f"ftcore ended (exit {proc.returncode}) before the awaited moment: {err[-3000:]}", pytrace=False)


def complete_checkpoints(run_dir: Path, stage: str) -> list[int]:
    """Steps of the stage's checkpoints that are marked complete (the ones ``--resume`` may use)."""
    folder = Path(run_dir) / "stages" / stage / "checkpoints"
    steps = [int(c.name.rpartition("-")[2]) for c in folder.glob("checkpoint-*") if (c / "COMPLETE.json").exists()]
    return sorted(steps)


# -- tiny models and stage contexts --------------------------------------------------------------------
@dataclass
class TinyModel:
    """A randomly initialised causal LM, its tokenizer and the ``chatml`` template, prepared together."""

    model: Any
    tokenizer: Any
    template: Any

    def copy(self) -> TinyModel:
        return TinyModel(copy.deepcopy(self.model), copy.deepcopy(self.tokenizer), self.template)


def tiny_model(work_dir: Path, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
               vocab_size: int = 300, rows: list[dict[str, Any]] | None = None, seed: int = 0,
               **options: Any) -> TinyModel:
    """A model built from a config by the ``scratch`` loader (a Llama by default; ``options`` are its
    other options, e.g. ``architecture="qwen2"``), with a BPE tokenizer trained on ``rows`` (default:
    tiny chat and text rows) and the ``chatml`` template. Nothing is downloaded."""
    import datasets

    from ftcore.context import LoadContext, RunInfo
    from ftcore_plugins.models.scratch import ScratchModelLoader
    from ftcore_plugins.quantizers.none import NoQuantizer
    from ftcore_plugins.templates.chatml import ChatMLTemplate

    rows = rows if rows is not None else chat_rows(64) + text_rows(64)
    loader = ScratchModelLoader(ScratchModelLoader.Options(
        hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads, vocab_size=vocab_size,
        tokenizer_data=["rows"], **options))
    run = RunInfo(plan=None, run_dir=Path(work_dir))
    model, tokenizer = loader.load(LoadContext(run, RecordingReporter(), NoQuantizer(), seed=seed,
                                               work_dir=Path(work_dir) / "model",
                                               data={"rows": datasets.Dataset.from_list(rows)}.__getitem__))
    template = ChatMLTemplate()
    model, tokenizer = template.prepare(model, tokenizer)
    return TinyModel(model, tokenizer, template)


class RecordingReporter:
    """A reporter without console or run folder that keeps what it is given: ``records`` (each
    ``log`` call: ``{"stage", "step", **metrics}``), ``warnings`` and ``infos``. Tables, data reports
    and progress bars are accepted and dropped."""

    def __init__(self):
        from ftcore.reporter import Reporter

        self._quiet = Reporter(None, None, None, None)
        self.records: list[dict[str, Any]] = []
        self.warnings: list[str] = []
        self.infos: list[str] = []

    def log(self, stage: str, metrics: dict[str, Any], step: int | None = None) -> None:
        self.records.append({"stage": stage, "step": step, **metrics})

    def warn(self, message: str) -> None:
        self.warnings.append(message)

    def info(self, message: str) -> None:
        self.infos.append(message)

    def losses(self, stage: str | None = None, key: str = "loss") -> dict[int, float]:
        """Logged ``key`` by step, for one stage or all."""
        return {r["step"]: r[key] for r in self.records if key in r and (stage is None or r["stage"] == stage)}

    def __getattr__(self, name: str) -> Any:  # table, data_report, progress: as a reporter with no console
        return getattr(self._quiet, name)


def stage_context(model: TinyModel, folder: Path, rows: list[dict[str, Any]] | None = None, *,
                  eval_rows: list[dict[str, Any]] | None = None, stage: str = "sft", seed: int = 0,
                  resume_from: Path | None = None, **fields: Any) -> Any:
    """A ``StageContext`` for calling a trainer's ``train(ctx)`` directly, without a plan: the tiny
    model, ``rows`` (default: 64 chat rows) as ``train_data``, a :class:`RecordingReporter`, and
    the stage's folders under ``folder``. ``fields`` set other context fields (``adapter``, ...)."""
    import datasets

    from ftcore.context import RunInfo, StageContext

    folder = Path(folder)
    run = RunInfo(plan=None, run_dir=folder)  # one process, rank 0
    return StageContext(run, RecordingReporter(), stage, model.model, model.tokenizer, model.template,
                        datasets.Dataset.from_list(rows if rows is not None else chat_rows(64)),
                        datasets.Dataset.from_list(eval_rows) if eval_rows else None,
                        folder / "stages" / stage, folder / "stages" / stage / "checkpoints", resume_from,
                        seed=seed, **fields)


# -- fixtures ------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def ftcore_cache_dir(tmp_path_factory) -> Path:
    """A cache of tokenized data for this test session, never the user's."""
    return tmp_path_factory.mktemp("ftcore-cache")


@pytest.fixture
def _ftcore_isolated(ftcore_cache_dir, monkeypatch) -> dict[str, str]:
    env = {"FTCORE_CACHE_DIR": str(ftcore_cache_dir), "HF_DATASETS_CACHE": str(ftcore_cache_dir / "hf-datasets")}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


@pytest.fixture
def ftcore_plan(tmp_path) -> Callable[..., Path]:
    """``ftcore_plan(overrides=None, toml="", name="plan.toml")``: :func:`write_plan` into ``tmp_path``."""

    def make(overrides: dict[str, Any] | None = None, toml: str = "", *, name: str = "plan.toml",
             data: bool = True) -> Path:
        return write_plan(tmp_path, overrides, toml, name=name, data=data)

    make.dir = tmp_path
    return make


@pytest.fixture
def ftcore_run(_ftcore_isolated) -> Callable[..., RunResult]:
    """``ftcore_run(*args, cwd=None, env=None, in_process=False)``: :func:`run_ftcore` with the
    session's own cache."""

    def run(*args: str | Path, env: dict[str, str] | None = None, **kwargs: Any) -> RunResult:
        return run_ftcore(*args, env={**_ftcore_isolated, **(env or {})}, **kwargs)

    return run


@pytest.fixture(scope="session")
def _ftcore_tiny_model_built(tmp_path_factory) -> TinyModel:
    return tiny_model(tmp_path_factory.mktemp("ftcore-tiny-model"))


@pytest.fixture
def ftcore_tiny_model(_ftcore_tiny_model_built) -> TinyModel:
    """A fresh copy (same initial weights every time) of a 2-layer, hidden-64 Llama with a
    300-token BPE tokenizer and the ``chatml`` template: :func:`tiny_model`."""
    return _ftcore_tiny_model_built.copy()


@pytest.fixture
def ftcore_stage(_ftcore_tiny_model_built, tmp_path, _ftcore_isolated) -> Callable[..., Any]:
    """``ftcore_stage(rows=None, eval_rows=None, stage="sft", model=None, **fields)``: a
    ``StageContext`` (:func:`stage_context`) on a fresh copy of the tiny model, in its own folder
    under ``tmp_path``; each call starts from the same initial weights."""
    count = iter(range(10_000))

    def make(rows: list[dict[str, Any]] | None = None, eval_rows: list[dict[str, Any]] | None = None, *,
             stage: str = "sft", model: TinyModel | None = None, **fields: Any) -> Any:
        return stage_context(model or _ftcore_tiny_model_built.copy(), tmp_path / f"stage{next(count)}", rows,
                             eval_rows=eval_rows, stage=stage, **fields)

    return make
