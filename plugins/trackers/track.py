"""The plan's ``track`` table, owned by the trackers: ``track = ["tensorboard", "mlflow"]``, or one
``[track.<name>]`` table of options per tracker. Each names a tracker component; ``ftcore run``
registers the ones selected as plugins for the length of the run (``PlanSection.components``)."""

from __future__ import annotations

from typing import Any

import ftcore
from ftcore.component import PlanSection
from ftcore.plan import type_name


class TrackSection(PlanSection):
    """[track]: the experiment trackers that see the run."""

    name = "track"

    @classmethod
    def parse(cls, table: Any, problem: Any, select: Any) -> list[Any]:
        listed = isinstance(table, list)
        if listed and all(isinstance(v, str) for v in table):
            table = {v: {} for v in table}
        if not isinstance(table, dict):
            problem("track", f"must be a list of tracker names or [track.<name>] tables, got {type_name(table)}")
            return []
        selected = []
        for i, (name, options) in enumerate(table.items()):
            key = f"track[{i}]" if listed else f"track.{name}"
            if not isinstance(options, dict):
                problem(key, f"must be a table ([track.{name}]), got {type_name(options)}")
                continue
            tracker = select("tracker", name, key, options)
            if tracker is not None:
                selected.append(tracker)
        return selected

    def components(self) -> list[Any]:
        return list(self.options or [])


@ftcore.hookimpl
def register_plan_sections(register):
    register(TrackSection)
