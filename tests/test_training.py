"""The training machinery every trainer gets: gradient accumulation normalised by tokens, LR
schedules, checkpoints (atomic, rotated, best kept), early stopping, exact resume after SIGKILL,
SIGINT/SIGTERM handling and the stability guard."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftcore.testing import wait_until  # polls a run; fails the test if it ends first

from conftest import run_cli, start_cli

WORDS = ["cat", "dog", "red", "blue", "tree", "stone", "runs", "sees", "the", "a"]


def varied_rows(n: int, seed: int = 0, words: list[str] = WORDS) -> list[dict]:
    """Chat rows of very different lengths (1-12 prompt words, 1-20 answer words)."""
    rng = random.Random(seed)
    return [{"messages": [{"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(1, 12)))},
                          {"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(1, 20)))}]}
            for _ in range(n)]


class Recorder:
    """A Reporter that keeps what it was told (metrics records and warnings) in memory."""

    def __init__(self):
        from ftcore.reporter import Reporter

        self._quiet = Reporter(None, None, None, None)
        self.records: list[dict] = []
        self.warnings: list[str] = []

    def log(self, stage, metrics, step=None):
        self.records.append({"step": step, **metrics})

    def warn(self, message):
        self.warnings.append(message)

    def __getattr__(self, name):  # info, table, progress, data_report: quiet
        return getattr(self._quiet, name)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny scratch model (hidden 32, one layer) with its tokenizer and chat template; ``make(rows,
    **options)`` runs the real ``sft`` trainer on a fresh copy of it and returns (metrics, ctx)."""
    import datasets

    from ftcore.context import LoadContext, StageContext
    from ftcore_plugins.models.scratch import ScratchModelLoader
    from ftcore_plugins.quantizers.none import NoQuantizer
    from ftcore_plugins.templates.chatml import ChatMLTemplate
    from ftcore_plugins.trainers.sft import SFTTrainer

    root = tmp_path_factory.mktemp("tiny")
    vocab = datasets.Dataset.from_list(varied_rows(64) + varied_rows(64, 1, ["fish", "moon", "sky", "green"]))
    from ftcore.context import RunInfo

    run = RunInfo(plan=None, run_dir=root)  # a single process, rank 0
    loader = ScratchModelLoader(ScratchModelLoader.Options(hidden_size=32, num_layers=1, num_heads=2,
                                                           tokenizer_data=["chat"], vocab_size=200))
    model, tokenizer = loader.load(LoadContext(run, Recorder(), NoQuantizer(), seed=0, work_dir=root / "model",
                                               data={"chat": vocab}.__getitem__))
    template = ChatMLTemplate()
    model, tokenizer = template.prepare(model, tokenizer)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    runs = iter(range(1000))

    def make(rows, eval_rows=None, **options):
        model.load_state_dict(initial)
        folder = root / f"stage{next(runs)}"
        ctx = StageContext(run, Recorder(), "sft", model, tokenizer, template, datasets.Dataset.from_list(rows),
                           datasets.Dataset.from_list(eval_rows) if eval_rows else None,
                           folder, folder / "checkpoints", None, seed=0)
        options = {"max_length": 64, "logging_steps": 1, "save_steps": 1000, **options}
        metrics = SFTTrainer(SFTTrainer.Options(**options)).train(ctx)
        return metrics, ctx

    make.model, make.root = model, root
    return make


@pytest.fixture
def optimizer_steps():
    """Each optimizer step's gradients (before the step) and parameters (before and after), captured
    by torch's global optimizer hooks: nothing in the training path is replaced."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    steps: list[dict] = []

    def params(opt):
        return [p for g in opt.param_groups for p in g["params"]]

    def before(opt, args, kwargs):
        grads = [p.grad.flatten() for p in params(opt) if p.grad is not None]
        steps.append({"grad": torch.cat(grads).clone() if grads else None,
                      "before": torch.cat([p.detach().flatten() for p in params(opt)]).clone()})

    def after(opt, args, kwargs):
        steps[-1]["after"] = torch.cat([p.detach().flatten() for p in params(opt)]).clone()

    handles = [register_optimizer_step_pre_hook(before), register_optimizer_step_post_hook(after)]
    yield steps
    for h in handles:
        h.remove()


def poison(model, at_call: int, factor: float):
    """A forward hook on the final norm that multiplies the hidden states (so the logits) by
    ``factor`` on the ``at_call``-th training forward (one per optimizer step here): NaN makes a NaN
    loss, a large number a loss spike."""
    calls = [0]

    def hook(module, args, output):
        if module.training:
            calls[0] += 1
            if calls[0] == at_call:
                return output * factor
        return output

    return model.get_decoder().norm.register_forward_hook(hook)


def losses_by_step(records):
    return {r["step"]: r["loss"] for r in records if "loss" in r}


# -- gradient accumulation -----------------------------------------------------------------
def test_gradient_accumulation_matches_one_big_batch(tiny, optimizer_steps):
    """bs8 x GA1 and bs1 x GA8 give the same gradient on variable-length samples: the loss is
    normalised by the trainable tokens of all micro-batches, not averaged per micro-batch (with a
    per-micro-batch mean the relative difference here is 0.39)."""
    rows = varied_rows(8, seed=3)
    lengths = [len(r["messages"][1]["content"].split()) for r in rows]
    assert max(lengths) >= 3 * min(lengths)  # really variable
    tiny(rows, max_steps=1, batch_size=8, gradient_accumulation_steps=1, max_grad_norm=0)
    tiny(rows, max_steps=1, batch_size=1, gradient_accumulation_steps=8, max_grad_norm=0)
    assert len(optimizer_steps) == 2
    a, b = optimizer_steps[0]["grad"], optimizer_steps[1]["grad"]
    assert ((a - b).norm() / a.norm()).item() <= 1e-5


# -- learning-rate schedules ---------------------------------------------------------------
@pytest.mark.parametrize("scheduler", ["linear", "cosine", "constant"])
def test_logged_learning_rate_follows_the_schedule_with_warmup(tiny, scheduler):
    total, warmup, base = 10, 3, 1e-3

    def expected(k):  # the rate used by step k + 1 (k steps done), as transformers defines them
        if k < warmup:
            return base * k / warmup
        if scheduler == "constant":
            return base
        progress = (k - warmup) / (total - warmup)
        return base * (max(0.0, 1 - progress) if scheduler == "linear" else 0.5 * (1 + math.cos(math.pi * progress)))

    metrics, ctx = tiny(varied_rows(40), max_steps=total, batch_size=4, learning_rate=base,
                        lr_scheduler=scheduler, warmup_steps=warmup)
    logged = {r["step"]: r["learning_rate"] for r in ctx.reporter.records if "learning_rate" in r}
    assert sorted(logged) == list(range(1, total + 1))
    for step, lr in logged.items():
        assert lr == pytest.approx(expected(step - 1), rel=1e-9, abs=1e-15), step
    # warmup_ratio gives the same warmup as the step count it works out to
    _, ctx = tiny(varied_rows(40), max_steps=total, batch_size=4, learning_rate=base,
                  lr_scheduler=scheduler, warmup_ratio=0.3)
    assert {r["step"]: r["learning_rate"] for r in ctx.reporter.records if "learning_rate" in r} == \
        pytest.approx(logged)


# -- stability guard -----------------------------------------------------------------------
def test_nan_loss_with_skip_leaves_weights_unchanged_and_training_goes_on(tiny, optimizer_steps):
    hook = poison(tiny.model, at_call=3, factor=float("nan"))
    try:
        metrics, ctx = tiny(varied_rows(32), max_steps=6, batch_size=4, learning_rate=1e-2, guard_nan="skip")
    finally:
        hook.remove()
    assert len(optimizer_steps) == 6 and metrics["global_step"] == 6
    for i, step in enumerate(optimizer_steps, start=1):
        unchanged = bool((step["before"] == step["after"]).all())
        assert unchanged == (i == 3), f"step {i}"  # only the poisoned step left the weights as they were
    assert metrics["guard_skipped_steps"] == 1
    assert any("step 3" in w and "nan" in w and "skipped" in w for w in ctx.reporter.warnings)
    assert any(r["step"] == 3 and r.get("guard/skipped_steps") == 1 for r in ctx.reporter.records)
    losses = losses_by_step(ctx.reporter.records)
    assert 3 not in losses and all(math.isfinite(v) for v in losses.values())  # no made-up loss for step 3
    assert metrics["train_loss"] == pytest.approx(sum(losses.values()) / len(losses), rel=1e-6)


def test_nan_loss_stops_with_one_line_naming_stage_step_and_advice(tiny):
    from ftcore.errors import FtcoreError

    hook = poison(tiny.model, at_call=2, factor=float("inf") * 0)
    try:
        with pytest.raises(FtcoreError) as err:
            tiny(varied_rows(32), max_steps=6, batch_size=4)  # guard_nan = "stop" by default
    finally:
        hook.remove()
    message = str(err.value)
    assert "\n" not in message
    assert "stage sft" in message and "step 2" in message and "nan" in message
    assert "learning_rate" in message and "bf16" in message and "data" in message


def test_out_of_memory_in_a_step_stops_with_one_line_naming_stage_step_peak_and_fixes(tiny):
    """A MemoryError forced inside the third step's forward (a CPU cannot run out of memory on cue; the
    path is the same for torch.OutOfMemoryError on a GPU): one line, and no half-written file."""
    from ftcore.errors import FtcoreError

    calls = [0]

    def hook(module, args, output):
        if module.training:
            calls[0] += 1
            if calls[0] == 3:
                raise MemoryError
        return output

    handle = tiny.model.get_decoder().norm.register_forward_hook(hook)
    try:
        with pytest.raises(FtcoreError) as err:
            tiny(varied_rows(32), max_steps=6, batch_size=4, save_steps=1)
    finally:
        handle.remove()
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("stage sft: out of memory at step 3 (measured peak: peak_rss ")
    assert "batch_size = 2 with gradient_accumulation_steps = 2" in message
    assert "gradient_checkpointing = true" in message and "max_length (now 64)" in message
    assert "ftcore estimate" in message
    # The two finished steps' checkpoints are complete and marked; the third step left nothing.
    folder = next(p for p in sorted(tiny.root.glob("stage*")) if (p / "checkpoints").exists() and
                  sorted(c.name for c in (p / "checkpoints").glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"])
    assert all((c / "COMPLETE.json").exists() for c in (folder / "checkpoints").glob("checkpoint-*"))
    assert not (folder / "output").exists()


def test_loss_spike_and_high_gradient_norm_are_warned_with_step_and_value(tiny):
    hook = poison(tiny.model, at_call=8, factor=60.0)
    try:
        metrics, ctx = tiny(varied_rows(40), max_steps=10, batch_size=4, guard_spike_factor=2.0,
                            guard_spike_window=5, guard_max_grad_norm=1e-6)
    finally:
        hook.remove()
    records, losses = ctx.reporter.records, losses_by_step(ctx.reporter.records)
    spikes = [r for r in records if "guard/loss_spike" in r]
    assert [r["step"] for r in spikes] == [8] and metrics["guard_loss_spikes"] == 1
    assert spikes[0]["guard/loss_spike"] == pytest.approx(losses[8], rel=1e-6)  # the loss the Trainer logged
    assert spikes[0]["guard/loss_recent_mean"] == pytest.approx(sum(losses[s] for s in range(3, 8)) / 5, rel=1e-6)
    assert any("loss spike at step 8" in w for w in ctx.reporter.warnings)
    # every step's norm is above the tiny threshold; the warned value is the (pre-clipping) norm logged
    norms = {r["step"]: r["grad_norm"] for r in records if "grad_norm" in r}
    high = {r["step"]: r["guard/grad_norm_high"] for r in records if "guard/grad_norm_high" in r}
    assert high == pytest.approx(norms) and len(high) == 10 and metrics["guard_high_grad_norms"] == 10
    assert any("gradient norm" in w and "at step 1 " in w for w in ctx.reporter.warnings)


# -- early stopping, best checkpoint, rotation ---------------------------------------------
def test_early_stopping_when_eval_loss_stops_improving_keeps_and_ends_with_the_best_checkpoint(tiny):
    """Training on one vocabulary makes the loss on another one stop improving: early stopping
    ends the stage long before max_steps; the best checkpoint by eval loss survives
    save_total_limit = 1, and the stage ends with its weights."""
    from safetensors.torch import load_file

    other = varied_rows(16, 5, ["fish", "moon", "sky", "green"])
    metrics, ctx = tiny(varied_rows(64), other, max_steps=200, batch_size=8, learning_rate=3e-2,
                        eval_steps=2, early_stopping_patience=2, save_total_limit=1)
    evals = {r["step"]: r["eval_loss"] for r in ctx.reporter.records if "eval_loss" in r}
    assert metrics["stopped_early"] and metrics["global_step"] < 40
    best_step = min(evals, key=evals.get)
    assert metrics["best_step"] == best_step and metrics["best_eval_loss"] == evals[best_step]
    after_best = [s for s in evals if s > best_step]
    assert len(after_best) == 2 and metrics["global_step"] == max(after_best)  # patience 2
    kept = sorted(p.name for p in ctx.checkpoint_dir.glob("checkpoint-*"))
    assert kept == sorted({f"checkpoint-{best_step}", f"checkpoint-{metrics['global_step']}"})
    assert all((ctx.checkpoint_dir / k / "COMPLETE.json").exists() for k in kept)
    assert metrics["final_model"] == "best"
    saved = load_file(ctx.checkpoint_dir / f"checkpoint-{best_step}" / "model.safetensors")
    live = ctx.model.state_dict()
    assert all((live[k] == v).all() for k, v in saved.items())


def test_rotation_keeps_the_newest_marked_and_the_best_and_resume_ignores_half_written(tmp_path):
    from ftcore.runner import _last_checkpoint
    from ftcore_plugins.trainers._callbacks import mark_checkpoint, rotate_checkpoints

    for step in (2, 4, 6, 8):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "model.safetensors").write_bytes(b"x" * 100)
        if step != 8:
            mark_checkpoint(tmp_path / f"checkpoint-{step}", step)
    # checkpoint-8: a save killed halfway, truncated weights and no marker
    assert _last_checkpoint(tmp_path).name == "checkpoint-6"
    rotate_checkpoints(tmp_path, keep=1, protect=tmp_path / "checkpoint-2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-6", "checkpoint-8"]
    # an unmarked folder newer than every marked one may be a save in progress: left alone;
    # the newest marked one survives any limit
    rotate_checkpoints(tmp_path, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-6", "checkpoint-8"]
    assert _last_checkpoint(tmp_path).name == "checkpoint-6"


# -- validation ----------------------------------------------------------------------------
def test_validate_rejects_evaluation_options_without_eval_data_and_double_warmup(tiny_project):
    plan = tiny_project("""
[[stage]]
name = "sft"
trainer = "sft"
data = "chat"
early_stopping_patience = 2
eval_steps = 5
warmup_ratio = 0.1
warmup_steps = 3
lr_scheduler = "cosine_with_restarts"
""")
    result = run_cli("validate", str(plan))
    assert result.returncode == 2
    assert "lr_scheduler" in result.stderr and "'linear', 'cosine' or 'constant'" in result.stderr
    fixed = plan.read_text().replace('lr_scheduler = "cosine_with_restarts"\n', "")
    plan.write_text(fixed)
    result = run_cli("validate", str(plan))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert any("early_stopping_patience" in x and "eval_data" in x for x in lines)
    assert any("eval_steps" in x and "eval_data" in x for x in lines)
    assert any("warmup_steps" in x and "not both" in x for x in lines)
    plan.write_text(fixed.replace("warmup_steps = 3\n", "").replace('data = "chat"\n',
                                                                    'data = "chat"\neval_data = "chat_eval"\n'))
    assert run_cli("validate", str(plan)).returncode == 0


# -- resume and signals (real processes) -----------------------------------------------------
RESUMABLE = """
[[stage]]
name = "sft"
trainer = "sft"
data = "chat"
epochs = 2
batch_size = 6
max_length = 64
learning_rate = 3e-3
precision = "fp32"
logging_steps = 1
save_steps = 4
save_total_limit = 1
"""


QUIET = {**os.environ, "OMP_NUM_THREADS": "1"}  # same numerics in every run; kinder to a shared CPU


def start(plan: Path, *extra: str):
    return start_cli("run", str(plan), *extra, env=QUIET)


def step_losses(run: Path) -> list[tuple[int, float]]:
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if r["stage"] == "sft" and "loss" in r]


def stopped_by(sig: signal.Signals, proc, run: Path, plan: Path) -> int:
    """Send ``sig`` once the process has trained a step; check the clean stop; return its step."""
    checkpoints = run / "stages" / "sft" / "checkpoints"
    logged = len(step_losses(run))
    wait_until(proc, lambda: len(step_losses(run)) > logged)
    os.kill(proc.pid, sig)
    out, err = proc.communicate(timeout=3600)
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in err + out
    message = [line for line in err.splitlines() if "stopped at step" in line]
    assert len(message) == 1, err
    step = int(message[0].split("stopped at step ")[1].split(";")[0])
    assert f"checkpoint saved to {checkpoints / f'checkpoint-{step}'};" in message[0]
    assert message[0].endswith(f"resume with: ftcore run {plan} --resume")
    assert (checkpoints / f"checkpoint-{step}" / "COMPLETE.json").exists()
    assert json.loads((run / "manifest.json").read_text())["status"] == "interrupted"
    return step


@pytest.mark.slow
def test_killed_and_signalled_runs_resume_with_the_same_losses_as_an_uninterrupted_run(tiny_project):
    """One run is SIGKILLed once a checkpoint is marked, resumed and stopped with SIGTERM, resumed
    and stopped with SIGINT, and resumed to the end (2 epochs, checkpoints mid-epoch). Every loss
    any of these processes logged equals the uninterrupted run's loss at that step within 1e-6."""
    reference = tiny_project(RESUMABLE, name="reference.toml")
    reference.write_text(reference.read_text().replace('name = "tiny"', 'name = "reference"'))
    assert run_cli("run", str(reference), env=QUIET).returncode == 0
    expected = dict(step_losses(tiny_project.dir / "runs" / "reference"))
    assert sorted(expected) == list(range(1, 23))  # 64 rows / 6 = 11 steps per epoch, 2 epochs

    plan = tiny_project(RESUMABLE)
    run = tiny_project.dir / "runs" / "tiny"
    checkpoints = run / "stages" / "sft" / "checkpoints"
    proc = start(plan)
    try:
        wait_until(proc, lambda: any((c / "COMPLETE.json").exists() for c in checkpoints.glob("checkpoint-*")))
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.communicate()
    assert max(s for s, _ in step_losses(run)) < 22
    # A newer save that was killed halfway: truncated weights, no marker. Resume must not pick it.
    half = checkpoints / "checkpoint-9999"
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"\0" * 10)

    stops = [stopped_by(signal.SIGTERM, start(plan, "--resume"), run, plan)]
    stops.append(stopped_by(signal.SIGINT, start(plan, "--resume"), run, plan))
    resumed = run_cli("run", str(plan), "--resume", env=QUIET)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from checkpoint-{stops[-1]}" in resumed.stdout
    assert json.loads((run / "manifest.json").read_text())["status"] == "complete"
    assert json.loads((run / "stages" / "sft" / "COMPLETE.json").read_text())["metrics"]["global_step"] == 22
    assert any(s % 11 for s in stops)  # at least one resume from the middle of an epoch

    records = step_losses(run)
    assert {s for s, _ in records} == set(expected)
    for step, loss in records:  # every record, from the killed, the stopped and the resumed processes
        assert abs(loss - expected[step]) <= 1e-6, (step, loss, expected[step])

    # Four processes logged steps (a killed one perhaps some twice); the report keeps the last attempt's.
    from ftcore_plugins.commands.report import read_records

    attempts = [r["attempt"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                if r["stage"] == "sft" and "loss" in r]
    assert sorted(set(attempts)) == [1, 2, 3, 4]
    assert sorted(r["step"] for r in read_records(run) if r["stage"] == "sft" and "loss" in r) == list(range(1, 23))

    # The stage's totals cover all 22 steps, not those since the last resume: equal where deterministic.
    whole = json.loads((tiny_project.dir / "runs" / "reference" / "summary.json").read_text())["stages"]["sft"]
    pieced = json.loads((run / "summary.json").read_text())["stages"]["sft"]
    assert pieced["train_tokens"] == whole["train_tokens"] > 0
    assert abs(pieced["train_loss"] - whole["train_loss"]) <= 1e-6
    assert abs(whole["train_loss"] - sum(expected.values()) / len(expected)) <= 1e-6  # the mean step loss
    assert pieced["train_seconds"] > 0 and pieced["tokens_per_second"] == \
        pytest.approx(pieced["train_tokens"] / pieced["train_seconds"])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_stops_at_once_with_interrupted(sig):
    """The first signal only asks for a stop; the second raises Interrupted at once (the run records
    itself interrupted), naming the stage and the checkpoint a resume continues from."""
    code = f"""
import os, signal, time, tempfile, pathlib
from ftcore.errors import Interrupted
from ftcore_plugins.trainers._callbacks import GracefulStop, mark_checkpoint
folder = pathlib.Path(tempfile.mkdtemp())
(folder / "checkpoint-4").mkdir()
mark_checkpoint(folder / "checkpoint-4", 4)
try:
    with GracefulStop("sft", folder, "plan.toml") as stop:
        os.kill(os.getpid(), {int(sig)})
        time.sleep(0.2)
        print("asked", stop.requested, flush=True)
        os.kill(os.getpid(), {int(sig)})
        time.sleep(10)
        print("survived")
except Interrupted as exc:
    print(exc.exit_code, exc.message.replace(str(folder), "CHECKPOINTS"))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.splitlines() == [
        "asked True", f"{128 + sig} stage sft: {sig.name} again: stopped at once, without a checkpoint; resume "
                      "continues from CHECKPOINTS/checkpoint-4; resume with: ftcore run plan.toml --resume"]


@pytest.mark.slow
def test_warnings_go_to_stderr_and_library_chatter_to_the_log_only(tiny_project):
    """ftcore's own warnings (here the guard's, at every step) are on stderr, not stdout; transformers'
    "Loading weights" bar and library warnings are not on the console at all."""
    plan = tiny_project(RESUMABLE.replace("save_steps = 4", "save_steps = 4\nguard_max_grad_norm = 1e-9")
                        .replace("epochs = 2", "max_steps = 3"))
    result = run_cli("run", str(plan), env=QUIET)
    assert result.returncode == 0, result.stderr
    warned = [line for line in result.stderr.splitlines() if line.startswith("warning: stage sft: gradient norm")]
    assert len(warned) == 3, result.stderr
    assert "warning:" not in result.stdout and "[warning]" not in result.stdout.lower()  # DeepSpeed's format
    assert "Loading weights" not in result.stderr + result.stdout and "Warning:" not in result.stderr


@pytest.mark.slow
def test_ctrl_c_twice_leaves_the_run_interrupted_and_resumable(tiny_project):
    plan = tiny_project(RESUMABLE)
    run = tiny_project.dir / "runs" / "tiny"
    proc = start(plan)
    wait_until(proc, lambda: len(step_losses(run)) >= 2)
    os.kill(proc.pid, signal.SIGINT)
    time.sleep(0.05)  # two signals at once are one to Python; a step takes longer than this
    os.kill(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=3600)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    # Usually the second arrives mid-step; should the first have ended training already, it is the clean stop.
    assert "SIGINT again: stopped at once" in err or "SIGINT: stopped at step" in err, err
    assert json.loads((run / "manifest.json").read_text())["status"] == "interrupted"
    resumed = run_cli("run", str(plan), "--resume", env=QUIET)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((run / "stages" / "sft" / "COMPLETE.json").read_text())["metrics"]["global_step"] == 22
