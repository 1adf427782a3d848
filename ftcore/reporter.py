"""Console output, progress bars and metrics records for a run.

Only rank 0 writes files or draws; other ranks get a reporter that stays quiet, so
the same code runs under torchrun.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import rundir

log = logging.getLogger("ftcore")


class Progress:
    """A handle on one progress bar."""

    def __init__(self, bar: Any | None, task: Any | None):
        self._bar, self._task = bar, task

    def advance(self, n: float = 1) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, n)

    def update(self, completed: float | None = None, total: float | None = None, **fields: Any) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=completed, total=total, **fields)


class Reporter:
    def __init__(self, console: Any | None, metrics_path: Path | None, pm: Any | None, run: Any | None,
                 errors: Any | None = None):
        self.console = console  # a rich Console, or None on non-main ranks
        self.metrics_path = metrics_path
        self._pm = pm  # calls ftcore_log on plugins, main rank only
        self._run = run
        self._errors: Any | None = errors  # where warnings go; default, made when needed: a console on stderr
        self.attempt = 1  # which start of the run this process is: 1, then one more per --resume

    def info(self, message: str) -> None:
        log.info(_plain(message))
        if self.console is not None:
            self.console.print(message, highlight=False, soft_wrap=True)

    def warn(self, message: str) -> None:
        log.warning(_plain(message))
        if self.console is not None:  # on stderr, so that stdout stays the run's own output
            if self._errors is None:
                from rich.console import Console

                self._errors = Console(stderr=True, soft_wrap=True)
            self._errors.print(f"[yellow]warning:[/] {message}", highlight=False, soft_wrap=True)

    def data_report(self, name: str, values: dict[str, Any]) -> None:
        """Merge ``values`` under ``name`` into the run's data_report.json."""
        if self.metrics_path is None:  # not the main rank
            return
        path = self.metrics_path.with_name("data_report.json")
        report = json.loads(path.read_text()) if path.exists() else {}
        report[name] = {**report.get(name, {}), **values}
        rundir.write_text(path, json.dumps(report, indent=2) + "\n")
        log.info("data %s: %s", name, json.dumps(values))

    def table(self, title: str, columns: list[str], rows: list[list[Any]]) -> None:
        """Print a small table (main rank only); floats get 4 significant digits."""
        if self.console is None:
            return
        from rich.table import Table

        table = Table(title=title, title_justify="left")
        for i, col in enumerate(columns):
            table.add_column(col, justify="left" if i == 0 else "right")
        for row in rows:
            table.add_row(*(format_value(v) for v in row))
        self.console.print(table)

    def log(self, stage: str, metrics: dict[str, Any], step: int | None = None) -> None:
        """Record metrics: one line in metrics.jsonl and a ``ftcore_log`` hook call."""
        clean = {k: _number(v) for k, v in metrics.items()}
        if self.metrics_path is not None:
            # "attempt" tells apart the steps a resumed run redid after its checkpoint: readers keep the last.
            record = {"time": round(time.time(), 3), "stage": stage, "step": step, "attempt": self.attempt, **clean}
            with self.metrics_path.open("a", encoding="utf-8") as fh:
                fh.write(json.dumps(record) + "\n")
        if self._pm is not None:
            for problem in self._pm.notify("ftcore_log", run=self._run, stage=stage, step=step, metrics=clean):
                self.warn(problem)

    @contextlib.contextmanager
    def progress(self, description: str, total: float | None) -> Iterator[Progress]:
        if self.console is None:
            yield Progress(None, None)
            return
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn,
                                   TimeElapsedColumn, TimeRemainingColumn)

        columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[note]}")]
        # 2 redraws a second: rich's default 10 took ~1.4% of a core while training (benchmarks/overhead.py).
        with RichProgress(*columns, console=self.console, transient=False, refresh_per_second=2) as bar:
            task = bar.add_task(description, total=total, note="")
            yield Progress(bar, task)


def format_value(v: Any) -> str:
    """How every table ftcore prints or writes shows a value: floats to 4 significant digits, None blank."""
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def _plain(message: str) -> str:
    """The message without rich markup, for the log file."""
    from rich.text import Text

    return Text.from_markup(message).plain


def _number(v: Any) -> Any:
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return str(v)
    if hasattr(v, "item"):  # a 0-d tensor or numpy scalar
        return v.item()
    return v
