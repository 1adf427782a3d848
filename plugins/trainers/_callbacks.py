"""Training machinery shared by every trainer: checkpoint marking and rotation, stopping on
SIGINT/SIGTERM at a step boundary, and the stability guard (NaN/inf, loss spikes, gradient norm).

The plain functions and ``GracefulStop`` work without a transformers Trainer, so a trainer with
its own loop (PPO) uses the same pieces; the ``TrainerCallback`` factories plug them into one.
"""

from __future__ import annotations

import math
import re
import shutil
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ftcore import rundir
from ftcore.errors import FtcoreError, Interrupted

CHECKPOINT = re.compile(r"checkpoint-(\d+)")
NAN_ADVICE = ("try a lower learning_rate, precision = \"bf16\" instead of \"fp16\", or check the data for "
              "broken samples; guard_nan = \"skip\" skips such steps instead")


# -- checkpoints ---------------------------------------------------------------------------
def mark_checkpoint(folder: Path, step: int) -> None:
    """Mark a checkpoint folder complete, after everything else in it is written. Resume
    (``ftcore.runner._last_checkpoint``) only picks marked folders, so a save killed halfway is skipped."""
    rundir.write_json(Path(folder) / rundir.COMPLETE, {"global_step": step, "finished_at": rundir.now()})


def checkpoints(folder: Path) -> list[tuple[int, Path, bool]]:
    """``(step, path, marked)`` for each ``checkpoint-N`` folder, oldest first."""
    found = []
    for child in Path(folder).glob("checkpoint-*"):
        m = CHECKPOINT.fullmatch(child.name)
        if m and child.is_dir():
            found.append((int(m.group(1)), child, (child / rundir.COMPLETE).exists()))
    return sorted(found)


def newest_checkpoint(folder: Path) -> Path | None:
    """The newest marked checkpoint: the one ``--resume`` continues from."""
    marked = [path for _, path, done in checkpoints(folder) if done]
    return marked[-1] if marked else None


def rotate_checkpoints(folder: Path, keep: int | None, protect: Path | str | None = None) -> list[Path]:
    """Delete all but the ``keep`` newest marked checkpoints, never the newest marked one nor
    ``protect`` (the best), and unmarked leftovers of killed saves older than the newest marked one.
    Called only after a new checkpoint is marked, so a resumable one always survives. Returns what
    was deleted."""
    found = checkpoints(folder)
    marked = [path for _, path, done in found if done]
    if not marked:
        return []
    newest_step = max(step for step, _, done in found if done)
    keep_paths = set(marked[-max(keep or 0, 1):]) if keep is not None else set(marked)
    if protect:
        keep_paths.add(Path(protect).resolve())
    keep_paths = {p.resolve() for p in keep_paths}
    deleted = []
    for step, path, done in found:
        if path.resolve() in keep_paths or (not done and step >= newest_step):
            continue
        # Unmark first: a kill during the deletion leaves a folder resume ignores.
        (path / rundir.COMPLETE).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
        deleted.append(path)
    return deleted


def checkpoint_keeper(save_total_limit: int | None, save_each_evaluation: bool = False,
                      totals: StageTotals | None = None):
    """A callback that marks each checkpoint the Trainer saved, then rotates the folder (keeping the
    best by the Trainer's ``best_model_checkpoint``). ``save_each_evaluation`` saves a checkpoint at
    every evaluation, so the best one by eval loss is always on disk. ``totals`` are saved into each
    checkpoint before it is marked, so a resumed stage reports totals over all its steps."""
    from transformers import TrainerCallback

    class CheckpointKeeper(TrainerCallback):
        def on_evaluate(self, args, state, control, **kw):
            if save_each_evaluation:
                control.should_save = True

        def on_save(self, args, state, control, **kw):
            from ftcore_plugins.common.launch import barrier

            barrier()  # every rank has written its part (DeepSpeed and FSDP shards) before rank 0 marks it
            if not state.is_world_process_zero:
                return
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if folder.is_dir():
                if totals is not None:
                    totals.save(folder)
                mark_checkpoint(folder, state.global_step)
                rotate_checkpoints(Path(args.output_dir), save_total_limit, state.best_model_checkpoint)

    return CheckpointKeeper()


# -- signals -------------------------------------------------------------------------------
class GracefulStop:
    """While active, SIGINT and SIGTERM only ask for a stop (``requested``); the training loop stops
    at the end of its current step, saves a checkpoint and raises :meth:`interrupted`. A second
    signal stops at once, without a checkpoint: it raises :class:`Interrupted` wherever the loop is,
    so the run still records itself as interrupted and ``--resume`` continues from the last marked
    checkpoint (a save it cut short is unmarked, and skipped). ``stage``, ``checkpoints`` (the folder)
    and ``plan_path`` go into that message. Use as a context manager around the training loop:

        with GracefulStop() as stop:
            for step in ...:
                ...
                if stop.requested: save(); raise stop.interrupted(stage, step, folder, plan_path)
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, stage: str | None = None, checkpoints: Path | None = None, plan_path: Any = None):
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        self.stage, self.checkpoints, self.plan_path = stage, checkpoints, plan_path

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum, frame):
        if self.signum is None:
            self.signum = signum
            return
        # The second signal: no more waiting. A third while this one unwinds gets the default action.
        for sig in self.SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        last = newest_checkpoint(self.checkpoints) if self.checkpoints else None
        where = f"resume continues from {last}" if last else "no checkpoint was saved yet"
        raise Interrupted(f"{'stage ' + self.stage + ': ' if self.stage else ''}{signal.Signals(signum).name} "
                          f"again: stopped at once, without a checkpoint; {where}; resume with: ftcore run "
                          f"{self.plan_path or '<plan>'} --resume", 128 + signum)

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def interrupted(self, stage: str, step: int, checkpoint: Path | None, plan_path: Any = None) -> Interrupted:
        name = signal.Signals(self.signum).name
        if checkpoint is None:
            where = "no checkpoint was saved"
        elif Path(checkpoint).name == f"checkpoint-{step}":
            where = f"checkpoint saved to {checkpoint}"
        else:  # the signal came after the last step: resume continues from the last checkpoint
            where = f"the last checkpoint is {checkpoint}"
        return Interrupted(f"stage {stage}: {name}: stopped at step {step}; {where}; "
                           f"resume with: ftcore run {plan_path or '<plan>'} --resume", 128 + self.signum)


def stop_on_signal(stop: GracefulStop):
    """A callback that ends training at the end of the step in which a signal arrived, saving a
    checkpoint there (the keeper marks it)."""
    from transformers import TrainerCallback

    class StopOnSignal(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if _any_rank(stop.requested):  # every rank stops at the same step
                control.should_save = True
                control.should_training_stop = True

    return StopOnSignal()


def _any_rank(flag: bool) -> bool:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    import torch

    value = torch.tensor([float(flag)], device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


# -- stability guard -----------------------------------------------------------------------
class StageTotals:
    """A stage's running totals over every step it trained, across resumes: the sum of the trained
    steps' losses and their count, the real tokens and the seconds spent training. Saved into each
    checkpoint (``FILE``) and read back from the one a resumed stage continues from, so that the
    stage's ``train_loss``, ``train_tokens`` and ``tokens_per_second`` cover the whole stage; the
    steps redone after a resume count once, as in the run that was never stopped."""

    FILE = "ftcore_totals.json"
    FIELDS = ("loss_sum", "trained_steps", "skipped_steps", "loss_spikes", "high_grad_norms", "tokens", "seconds")

    def __init__(self, tokens: Callable[[], int | None] = lambda: None):
        self.base = dict.fromkeys(self.FIELDS, 0)  # what the checkpoint resumed from had counted
        self.loss_sum, self.trained = 0.0, 0
        self.guard: StabilityGuard | None = None
        self._tokens = tokens  # this attempt's real tokens so far (the trainer's own count), if it counts them
        self._start = time.perf_counter()

    def start(self) -> None:
        """Training starts now: seconds count from here."""
        self._start = time.perf_counter()

    def resume(self, checkpoint: Path | None) -> None:
        saved = rundir.read_json(Path(checkpoint) / self.FILE) if checkpoint else None
        if saved:
            self.base.update({k: saved[k] for k in self.FIELDS if k in saved})

    def add(self, loss: float) -> None:
        self.loss_sum += loss
        self.trained += 1

    def current(self) -> dict[str, Any]:
        guard = self.guard.counts() if self.guard else {}
        tokens = self._tokens()
        now = {"loss_sum": self.loss_sum, "trained_steps": self.trained,
               "skipped_steps": guard.get("guard_skipped_steps", 0), "loss_spikes": guard.get("guard_loss_spikes", 0),
               "high_grad_norms": guard.get("guard_high_grad_norms", 0), "tokens": tokens or 0,
               "seconds": time.perf_counter() - self._start}
        out = {k: self.base[k] + now[k] for k in self.FIELDS}
        if tokens is None and not self.base["tokens"]:
            out["tokens"] = None
        return out

    def save(self, folder: Path) -> None:
        rundir.write_json(Path(folder) / self.FILE, self.current())

    def metrics(self) -> dict[str, Any]:
        """The stage's totals as metrics: ``train_loss`` (mean over trained steps), ``train_tokens``,
        ``train_seconds``, ``tokens_per_second`` and the guard's counts."""
        t = self.current()
        out: dict[str, Any] = {
            "train_loss": t["loss_sum"] / t["trained_steps"] if t["trained_steps"] else float("nan"),
            "train_seconds": t["seconds"], "guard_skipped_steps": t["skipped_steps"],
            "guard_loss_spikes": t["loss_spikes"], "guard_high_grad_norms": t["high_grad_norms"]}
        if t["tokens"] is not None:
            out["train_tokens"] = int(t["tokens"])
            if t["seconds"]:
                out["tokens_per_second"] = t["tokens"] / t["seconds"]
        return out


class StabilityGuard:
    """Watches each optimizer step's loss and gradient norm (before clipping).

    ``check(step, loss, grad_norm)`` returns True when the step must not update the weights: a NaN or
    inf (``nan = "skip"``); with ``nan = "stop"`` it raises a one-line FtcoreError instead. A loss
    above ``spike_factor`` x the mean of the last ``window`` steps, and a gradient norm above
    ``max_grad_norm``, are warned about with step and value and recorded as metrics."""

    def __init__(self, reporter: Any, stage: str, *, nan: str = "stop", spike_factor: float | None = None,
                 window: int = 20, max_grad_norm: float | None = None):
        self.reporter, self.stage, self.nan = reporter, stage, nan
        self.spike_factor, self.max_grad_norm = spike_factor, max_grad_norm
        self.recent: deque[float] = deque(maxlen=window)
        self.skipped = self.spikes = self.high_grad_norms = 0

    def check(self, step: int, loss: float, grad_norm: float | None) -> bool:
        bad = next(((what, v) for what, v in (("loss", loss), ("gradient norm", grad_norm))
                    if v is not None and not math.isfinite(v)), None)
        if bad is not None:
            what, value = bad
            if self.nan == "stop":
                raise FtcoreError(f"stage {self.stage}: the {what} is {value} at step {step}; training stopped "
                                  f"(guard_nan = \"stop\"): {NAN_ADVICE}")
            self.skipped += 1
            self.reporter.warn(f"stage {self.stage}: the {what} is {value} at step {step}; skipped the step "
                               f"(no weight changed; {self.skipped} skipped so far)")
            self.reporter.log(self.stage, {f"guard/skipped_{what.replace(' ', '_')}": value,
                                           "guard/skipped_steps": self.skipped}, step=step)
            return True
        if self.max_grad_norm is not None and grad_norm is not None and grad_norm > self.max_grad_norm:
            self.high_grad_norms += 1
            self.reporter.warn(f"stage {self.stage}: gradient norm {grad_norm:.4g} at step {step} is above "
                               f"guard_max_grad_norm = {self.max_grad_norm:g}")
            self.reporter.log(self.stage, {"guard/grad_norm_high": grad_norm}, step=step)
        full = len(self.recent) >= min(5, self.recent.maxlen)  # a mean of a step or two says little
        mean = sum(self.recent) / len(self.recent) if self.recent else 0.0
        if self.spike_factor is not None and full and mean > 0 and loss > self.spike_factor * mean:
            self.spikes += 1
            self.reporter.warn(f"stage {self.stage}: loss spike at step {step}: {loss:.4g} is "
                               f"{loss / mean:.1f}x the mean {mean:.4g} of the last {len(self.recent)} steps")
            self.reporter.log(self.stage, {"guard/loss_spike": loss, "guard/loss_recent_mean": mean}, step=step)
        else:  # a spike stays out of the mean, so the next one is measured against normal steps
            self.recent.append(loss)
        return False

    def counts(self) -> dict[str, int]:
        return {"guard_skipped_steps": self.skipped, "guard_loss_spikes": self.spikes,
                "guard_high_grad_norms": self.high_grad_norms}


def attach_guard(trainer: Any, guard: StabilityGuard, totals: StageTotals | None = None):
    """Feed ``guard`` from a transformers Trainer and return the callback that acts on it.

    The Trainer hands callbacks neither the loss nor the gradient norm, so this wraps two of its
    methods on the instance: ``training_step`` (each micro-batch's loss, already scaled so that
    their sum is the step's loss) and ``_get_grad_norm`` (the norm before clipping). The losses are
    held back and added to the Trainer's running loss only for steps that update the weights, so a
    skipped step is left out of the logged loss instead of making it NaN. A skipped step drops
    every gradient before ``optimizer.step()``: optimizers leave parameters without a gradient
    untouched (no moment update, no weight decay). Each trained step's loss is added to ``totals``."""
    import torch
    from transformers import TrainerCallback

    held: list[Any] = []
    norm: list[Any] = [None]
    training_step, get_grad_norm = trainer.training_step, trainer._get_grad_norm

    def guarded_training_step(*args, **kwargs):
        loss = training_step(*args, **kwargs)
        held.append(loss)
        return torch.zeros_like(loss)

    def recorded_grad_norm(*args, **kwargs):
        norm[0] = get_grad_norm(*args, **kwargs)
        return norm[0]

    trainer.training_step, trainer._get_grad_norm = guarded_training_step, recorded_grad_norm

    class Guard(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kw):
            loss = torch.stack(held).sum()
            held.clear()
            value, grad_norm = to_host(_mean_over_ranks(loss), norm[0])
            if guard.check(state.global_step + 1, value, grad_norm):
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        p.grad = None
                # The logged loss is a mean over the steps since the last log: count this one out.
                trainer._globalstep_last_logged += 1
            else:
                trainer._tr_loss += loss.to(trainer._tr_loss.device)
                if totals is not None:
                    totals.add(value)

    return Guard()


def _mean_over_ranks(loss: Any) -> Any:
    """The step's loss averaged over ranks, as the Trainer logs it (a tensor); a NaN on any rank shows."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        loss /= dist.get_world_size()
    return loss


def to_host(loss: Any, grad_norm: Any) -> tuple[float, float | None]:
    """The step's loss and gradient norm as floats, read from the device together: one host sync a step."""
    import torch

    # FSDP2's norm (and a sharded loss) is a DTensor, which has no tolist: its full value first.
    loss, grad_norm = (t.full_tensor() if hasattr(t, "full_tensor") else t for t in (loss, grad_norm))
    if isinstance(grad_norm, torch.Tensor) and grad_norm.device == loss.device:
        both = torch.stack([loss.detach().float().reshape(()), grad_norm.detach().float().reshape(())]).tolist()
        return both[0], both[1]
    return loss.item(), None if grad_norm is None else float(grad_norm)
