"""The runner of ``ftcore sweep``'s runs: each trial (and the run of the shared stages) is the runner of
``ftcore run``, with the shared stages' folders linked into the trial's folder, so they count as done
there, and the base model and the shared stages' models kept in memory across the runs of the
process (:class:`ModelCache`), each run getting its own copy."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ftcore.runner import Runner


class ModelCache:
    """Models one process keeps between runs (``ftcore sweep``'s trials): the base model and the models
    after stages every trial shares are built once; each run gets its own deep copy, so training one
    never changes another's start. Holds one extra copy of each kept model."""

    def __init__(self) -> None:
        self._kept: dict[str, tuple[Any, Any]] = {}
        self.built = self.copied = 0

    def get(self, key: str, build: Any) -> tuple[Any, Any]:
        import copy

        if key not in self._kept:
            self.built += 1
            self._kept[key] = build()
        else:
            self.copied += 1
        return copy.deepcopy(self._kept[key])



class SweepRunner(Runner):
    """``shared_stages``: finished stage folders from another run of the same stages (the sweep's shared
    run), linked into this run's folder; ``models``: the process's :class:`ModelCache`, or None."""

    def __init__(self, *args: Any, shared_stages: dict[str, Path] | None = None, models: ModelCache | None = None,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.shared_stages, self.models = shared_stages or {}, models

    def _prepare(self) -> str:
        note = super()._prepare()
        for name, folder in self.shared_stages.items():
            link = self.stage_dir(next(s for s in self.plan.stages if s.name == name))
            if not (link.exists() or link.is_symlink()):
                link.parent.mkdir(parents=True, exist_ok=True)
                # Relative, so the folder holding both runs can move.
                link.symlink_to(os.path.relpath(folder, link.parent), target_is_directory=True)
        return note

    def _kept(self, key: list[Any], build: Any) -> tuple[Any, Any]:
        """A copy of what an earlier run of this process built: the base model, and the stages every run
        shares (a run's own would pile up, one per run). The quantizer in use is part of the key, to be
        safe: a model loaded through another one differs."""
        if self.models is None or not self.keeps_models or (key[0] == "stage" and key[1] not in self.shared_stages):
            return build()
        key = [*key, type(self.quantizer).__qualname__, self.quantizer.options.model_dump(mode="json")]
        return self.models.get(json.dumps(key, sort_keys=True, default=str), build)
