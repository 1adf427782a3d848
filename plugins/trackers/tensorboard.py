"""Tracker ``tensorboard``: metrics as TensorBoard scalars, in an event file under the run directory."""

from __future__ import annotations

import json

import ftcore
from ftcore import rundir
from ftcore.component import Component, Options
from ftcore.types import OutputPath

from ftcore_plugins.trackers import _base as _tracking


class TensorBoard(Component):
    """TensorBoard event file: every metric as a scalar, the plan and the run's status as text.

    Tags are ``<stage>/<metric>`` at the trainer's optimizer step; one-off values (step None) and
    each step's final metrics (``<stage>/final/<metric>``) are at step 0."""

    name = "tensorboard"

    class Options(Options):
        dir: OutputPath | None = None  # default: <run dir>/tracking/tensorboard

    def __init__(self, options=None):
        super().__init__(options)
        self._writer = None

    def check(self, plan):
        # torch.utils.tensorboard writes the event files but needs the tensorboard package.
        return _tracking.missing(("tensorboard",), "tensorboard")

    @ftcore.hookimpl
    def ftcore_run_start(self, run):
        if not run.is_main:
            return
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(_tracking.folder(run, self.options.dir, "tensorboard")))
        plan = json.dumps(run.plan.redacted(), indent=2, default=str)
        self._writer.add_text("plan", f"```\n{plan}\n```", 0)

    @ftcore.hookimpl
    def ftcore_log(self, run, stage, step, metrics):
        if self._writer is None:  # run_start failed; that was reported once already
            return
        for key, value in _tracking.numbers(metrics).items():
            self._writer.add_scalar(f"{stage}/{key}", value, step or 0)

    @ftcore.hookimpl
    def ftcore_stage_end(self, run, stage, metrics, seconds):
        if self._writer is None or not run.is_main:
            return
        for key, value in {**_tracking.numbers(metrics), "seconds": seconds}.items():
            self._writer.add_scalar(f"{stage}/final/{key}", value, 0)
        self._writer.flush()

    @ftcore.hookimpl
    def ftcore_run_end(self, run, error):
        if self._writer is None or not run.is_main:
            return
        status = rundir.run_status(error)
        self._writer.add_text("status", status if error is None else f"{status}: {_tracking.error_line(error)}", 0)
        self._writer.close()
        self._writer = None


@ftcore.hookimpl
def register_trackers(register):
    register(TensorBoard)
