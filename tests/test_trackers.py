"""Trackers: one tiny SFT run sends its metrics to TensorBoard, MLflow and W&B (offline), and each
tool's own reader gets back what metrics.jsonl holds. A failing run is marked failed; missing
libraries, unknown tracker names and misspelled tracker hooks are one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import ftcore
from ftcore.component import Component, Options
from ftcore.errors import FtcoreError, PlanError

from conftest import TINY_HEADER, chat_rows, run_cli, text_rows, write_jsonl

SFT = """
[track.tensorboard]

[track.mlflow]
tags = { team = "nlp", api_key = "abc123", note = "hf_abcdefghijklmnopqrstuvwx" }

[track.wandb]

[[stage]]
name = "sft"
trainer = "sft"
data = "chat"
adapter = "full"
max_steps = 5
batch_size = 8
max_length = 64
learning_rate = 3e-3
logging_steps = 1

[[evaluate]]
use = "perplexity"
data = "chat_eval"
"""


def _project(folder: Path, body: str) -> Path:
    """The tiny_project layout (conftest), in a folder a module-scoped fixture can share."""
    write_jsonl(folder / "text.jsonl", text_rows(64))
    write_jsonl(folder / "chat.jsonl", chat_rows(64))
    write_jsonl(folder / "chat_eval.jsonl", chat_rows(16, seed=1))
    # `track` is a top-level key: it must come before the header's first table.
    (folder / "plan.toml").write_text(body.split("\n[[stage]]")[0] + TINY_HEADER + "\n[[stage]]"
                                      + body.split("\n[[stage]]", 1)[1], encoding="utf-8")
    return folder / "plan.toml"


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """One real run with all three trackers; the tests below read what each one wrote."""
    folder = tmp_path_factory.mktemp("tracked")
    result = run_cli("run", str(_project(folder, SFT)), env={"MLFLOW_DISABLE_TELEMETRY": "true"})
    assert result.returncode == 0, result.stderr
    run = folder / "runs" / "tiny"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return run, records


def _stepped(records: list[dict]) -> dict[tuple[str, int], float]:
    """metrics.jsonl's numeric values that have a step, as (``stage/metric``, step) -> value."""
    out = {}
    for r in records:
        if r["step"] is None:
            continue
        for key, value in r.items():
            if key not in ("time", "stage", "step", "attempt") and isinstance(value, (int, float)):
                where = (f"{r['stage']}/{key}", r["step"])
                # transformers logs `epoch` twice at the last step; a metric has one value per step
                assert out.setdefault(where, float(value)) == float(value), where
    return out


@pytest.mark.slow
def test_tensorboard_event_file_holds_the_metrics_of_metrics_jsonl(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, records = tracked_run
    expected = _stepped(records)
    losses = [v for (key, _), v in sorted(expected.items(), key=lambda kv: kv[0][1]) if key == "sft/loss"]
    assert len(losses) == 5 and losses[-1] < losses[0]  # five optimizer steps, and training learned

    events = EventAccumulator(str(run / "tracking" / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    read = {(tag, e.step): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}
    for key, value in expected.items():
        assert read[key] == pytest.approx(value, rel=1e-6, abs=1e-6), key  # event files hold float32
    assert read[("sft/final/seconds", 0)] > 0
    status = events.Tensors("status/text_summary")[0].tensor_proto.string_val[0].decode()
    assert status == "complete"
    plan = events.Tensors("plan/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"hidden_size": 32' in plan


@pytest.mark.slow
def test_mlflow_run_has_metric_history_params_and_finished_status(tracked_run):
    from mlflow.tracking import MlflowClient

    run, records = tracked_run
    client = MlflowClient(tracking_uri=f"sqlite:///{run / 'tracking' / 'mlflow' / 'mlflow.db'}")
    [found] = client.search_runs([client.get_experiment_by_name("ftcore").experiment_id])
    assert found.info.status == "FINISHED" and found.info.run_name == "tiny"
    assert found.data.params["model.hidden_size"] == "32"
    assert found.data.params["stage.0.learning_rate"] == "0.003"
    assert found.data.params["model.tokenizer_data"] == '["text", "chat"]'
    assert found.data.tags["ftcore.run_dir"] == str(run)
    # A secret given as a tag is redacted there too, as in the manifest and the params: by its key or its shape.
    assert {k: found.data.tags[k] for k in ("team", "api_key", "note")} == {"team": "nlp", "api_key": "***",
                                                                           "note": "***"}
    manifest = (run / "manifest.json").read_text()
    assert "abc123" not in manifest and "hf_abcdefghijklmnopqrstuvwx" not in manifest
    assert not [k for k, v in found.data.params.items() if "abc123" in v or "hf_abcdef" in v]

    expected = _stepped(records)
    for key in {k for k, _ in expected}:
        history = {m.step: m.value for m in client.get_metric_history(found.info.run_id, key)}
        assert history == {step: v for (k, step), v in expected.items() if k == key}, key
    # One-off values (step None) land at step 0, e.g. the perplexity before and after training.
    before = next(r for r in records if r["stage"] == "evaluate:before")
    assert found.data.metrics["evaluate:before/perplexity/perplexity"] == before["perplexity/perplexity"]


@pytest.mark.slow
def test_wandb_offline_run_reads_back_with_wandbs_own_reader(tracked_run):
    run, records = tracked_run
    [folder] = (run / "tracking" / "wandb" / "wandb").glob("offline-run-*")

    history = {}
    for line in _wandb_inspect(folder).splitlines():
        item = json.loads(line).get("history", {}).get("item")
        for key, value in (item or {}).items():
            stage = key.split("/", 1)[0]
            if not key.startswith("_") and not key.endswith("/step"):
                history[(key, int(item[f"{stage}/step"]))] = float(value)
    assert history == _stepped(records)

    summary = json.loads(_wandb_inspect(folder, "--summary"))
    assert summary["state"] == "finished" and summary["exit_code"] == 0
    assert summary["name"] == "tiny" and summary["project"] == "ftcore"
    assert summary["config"]["model"]["hidden_size"] == 32
    assert summary["summary"]["ftcore/status"] == "complete"
    after = next(r for r in records if r["stage"] == "evaluate:after")
    assert summary["summary"]["evaluate:after/perplexity/perplexity"] == after["perplexity/perplexity"]


def _wandb_inspect(folder: Path, *flags: str) -> str:
    """W&B's own reader of a run's .wandb transaction log (`wandb leet inspect`, in wandb-core)."""
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", *flags, str(folder)],
                         capture_output=True, text=True, timeout=3600)  # only catches a hang
    assert out.returncode == 0, out.stderr
    return out.stdout


class Explode(Component):
    """A trainer that fails, or is interrupted, after training has begun."""

    name = "explode"

    class Options(Options):
        interrupt: bool = False

    def train(self, ctx):
        ctx.reporter.log(ctx.stage, {"loss": 1.5}, step=1)
        raise KeyboardInterrupt if self.options.interrupt else RuntimeError("the GPU caught fire")


class MisspelledTracker(Component):
    """A third-party tracker whose second hook has a typo."""

    name = "typo"

    @ftcore.hookimpl
    def ftcore_log(self, run, stage, step, metrics):
        pass

    @ftcore.hookimpl
    def ftcore_stage_ended(self, run, stage, metrics, seconds):
        pass


class ThirdParty:
    @ftcore.hookimpl
    def register_trainers(self, register):
        register(Explode)

    @ftcore.hookimpl
    def register_trackers(self, register):
        register(MisspelledTracker)


def _runner(tmp_path: Path, body: str):
    from rich.console import Console

    from ftcore.plan import load_plan
    from ftcore.plugins import PluginInfo, get_plugin_manager
    from ftcore.runner import Runner

    pm = get_plugin_manager(entry_points=False)
    pm.add_plugin(ThirdParty(), PluginInfo("third-party", "third-party-dist", "1.0", "entry point"))
    pm.check_pending()
    plan = load_plan(_project(tmp_path, body), pm.registry())
    return Runner(plan, pm, Console(file=open(tmp_path / "out.txt", "w")))


@pytest.mark.slow
@pytest.mark.parametrize("interrupt, status, words, exit_code",
                         [(False, "FAILED", "failed: ComponentError: trainer 'explode'", 1),
                          (True, "KILLED", "interrupted: KeyboardInterrupt", 130)])
def test_a_run_that_fails_or_is_interrupted_ends_failed_or_killed(tmp_path, interrupt, status, words, exit_code):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runner = _runner(tmp_path, f"""
track = ["mlflow", "tensorboard", "wandb"]

[[stage]]
name = "boom"
trainer = "explode"
data = "chat"
interrupt = {str(interrupt).lower()}
""")
    with pytest.raises(BaseException):
        runner.run()
    tracking = tmp_path / "runs" / "tiny" / "tracking"
    client = MlflowClient(tracking_uri=f"sqlite:///{tracking / 'mlflow' / 'mlflow.db'}")
    [found] = client.search_runs([client.get_experiment_by_name("ftcore").experiment_id])
    assert found.info.status == status
    assert "the GPU caught fire" in found.data.tags["ftcore.error"] or interrupt
    assert [(m.step, m.value) for m in client.get_metric_history(found.info.run_id, "boom/loss")] == [(1, 1.5)]
    events = EventAccumulator(str(tracking / "tensorboard"))
    events.Reload()
    assert events.Tensors("status/text_summary")[0].tensor_proto.string_val[0].decode().startswith(words)
    [folder] = (tracking / "wandb" / "wandb").glob("offline-run-*")
    summary = json.loads(_wandb_inspect(folder, "--summary"))
    assert summary["exit_code"] == exit_code and summary["summary"]["ftcore/status"] == words.split(":")[0]


def test_a_tracker_with_a_misspelled_hook_is_a_one_line_error(tmp_path):
    runner = _runner(tmp_path, """
track = ["typo"]

[[stage]]
trainer = "explode"
data = "chat"
""")
    with pytest.raises(FtcoreError) as err:
        runner.run()
    message = str(err.value)
    assert "\n" not in message
    assert "tracker 'typo'" in message and "third-party-dist" in message
    assert "unknown hook 'ftcore_stage_ended'; did you mean 'ftcore_stage_end'?" in message


@pytest.mark.parametrize("tracker, module, pip", [("mlflow", "alembic", "mlflow-skinny sqlalchemy alembic"),
                                                  ("tensorboard", "tensorboard", "tensorboard"),
                                                  ("wandb", "wandb", "wandb")])
def test_a_missing_tracker_library_is_a_validation_error_naming_the_pip_package(tmp_path, monkeypatch,
                                                                                 tracker, module, pip):
    from ftcore.plan import load_plan
    from ftcore.plugins import get_plugin_manager

    monkeypatch.setitem(sys.modules, module, None)  # what find_spec reports for a module not installed
    with pytest.raises(PlanError) as err:
        load_plan(_project(tmp_path, f'track = ["{tracker}"]\n\n[[stage]]\ntrainer = "sft"\ndata = "chat"\n'),
                  get_plugin_manager(entry_points=False).registry())
    [problem] = err.value.problems
    assert problem.endswith(f"plan.toml: track[0]: needs {module}, which is not installed: "
                            f"pip install {pip} (or pip install 'ftcore[track]')")


def test_validate_names_an_unknown_tracker_and_suggests_the_right_one(tmp_path):
    plan = _project(tmp_path, 'track = ["tensorbord"]\n\n[[stage]]\ntrainer = "sft"\ndata = "chat"\n')
    result = run_cli("validate", str(plan))
    assert result.returncode == 2
    [line] = (result.stdout + result.stderr).splitlines()
    assert ": track[0]: " in line and "unknown tracker 'tensorbord'; did you mean 'tensorboard'?" in line
