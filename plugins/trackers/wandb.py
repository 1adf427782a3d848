"""Tracker ``wandb``: a Weights & Biases run, offline by default (upload it later with
``wandb sync``), with the redacted plan as its config."""

from __future__ import annotations

from typing import Literal

import ftcore
from ftcore import rundir
from ftcore.component import Component, Options
from ftcore.plan import redact
from ftcore.types import OutputPath

from ftcore_plugins.trackers import _base as _tracking



class WandB(Component):
    """Weights & Biases run, offline by default: metric history, summary, the plan as config.

    History ``<stage>/<metric>`` is plotted against the stage's own axis ``<stage>/step`` (the
    trainer's optimizer step: stages restart at 1, and W&B's own step only goes up). One-off values
    and each step's final metrics (``<stage>/final/<metric>``) go to the summary; the run's end to
    its exit code and ``ftcore/status``."""

    name = "wandb"

    class Options(Options):
        mode: Literal["offline", "online"] = "offline"  # online uploads as it goes; needs `wandb login`
        project: str = "ftcore"
        entity: str | None = None
        name: str | None = None  # default: the plan's [run] name
        tags: list[str] = []
        dir: OutputPath | None = None  # default: <run dir>/tracking/wandb

    def __init__(self, options=None):
        super().__init__(options)
        self._run = None
        self._stages: set[str] = set()

    def check(self, plan):
        return _tracking.missing(("wandb",), "wandb")

    @ftcore.hookimpl
    def ftcore_run_start(self, run):
        if not run.is_main:
            return
        import wandb

        o = self.options
        # console off: ftcore draws the console and keeps run.log itself. No git: a remote URL can
        # carry a token, and the run manifest already records the commit.
        settings = wandb.Settings(mode=o.mode, console="off", disable_git=True, save_code=False, quiet=True)
        self._run = wandb.init(dir=str(_tracking.folder(run, o.dir, "wandb")), project=o.project, entity=o.entity,
                               name=o.name or run.plan.run_name, tags=redact(list(o.tags)), config=run.plan.redacted(),
                               settings=settings)

    @ftcore.hookimpl
    def ftcore_log(self, run, stage, step, metrics):
        if self._run is None:  # run_start failed; that was reported once already
            return
        values = {f"{stage}/{k}": v for k, v in _tracking.numbers(metrics).items()}
        if step is None:
            self._run.summary.update(values)
            return
        if stage not in self._stages:
            self._stages.add(stage)
            self._run.define_metric(f"{stage}/*", step_metric=f"{stage}/step")
        self._run.log({**values, f"{stage}/step": step})

    @ftcore.hookimpl
    def ftcore_stage_end(self, run, stage, metrics, seconds):
        if self._run is None or not run.is_main:
            return
        values = {**_tracking.numbers(metrics), "seconds": seconds}
        self._run.summary.update({f"{stage}/final/{k}": v for k, v in values.items()})

    @ftcore.hookimpl
    def ftcore_run_end(self, run, error):
        if self._run is None or not run.is_main:
            return
        status = rundir.run_status(error)
        self._run.summary["ftcore/status"] = status
        if error is not None:
            self._run.summary["ftcore/error"] = _tracking.error_line(error)
        # The CLI's exit code: 2 for a plan/data error, 1 for others, 128 + the signal when stopped.
        code = 0 if error is None else getattr(error, "exit_code", 130 if status == "interrupted" else 1)
        self._run.finish(exit_code=code)
        self._run = None


@ftcore.hookimpl
def register_trackers(register):
    register(WandB)
