"""Field types for component options that the core resolves for plugins.

Relative paths in a plan resolve against the plan file's folder, whatever the
current directory is. Use these in an ``Options`` model::

    from ftcore.component import Options
    from ftcore.types import InputPath

    class Options(Options):
        path: InputPath
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, Field, ValidationInfo


def _resolve(value: Path, info: ValidationInfo) -> Path:
    base = (info.context or {}).get("base_dir")
    try:
        value = value.expanduser()
    except RuntimeError as exc:  # "~nosuchuser/..."
        raise ValueError(f"cannot expand {str(value)!r}: {exc}") from None
    if base is not None and not value.is_absolute():
        value = Path(base) / value
    return Path(str(value.resolve()) if base is not None else value)


def file_in_the_way(path: Path) -> Path | None:
    """The existing file (not folder) that ``path`` or one of its parents is, which makes writing to or
    under ``path`` as a folder impossible; None when there is none."""
    for p in (path, *path.parents):
        if p.exists():
            return None if p.is_dir() else p
    return None


def _output(value: Path, info: ValidationInfo) -> Path:
    value = _resolve(value, info)
    blocker = file_in_the_way(value.parent)
    if blocker is not None:
        raise ValueError(f"cannot write {value}: {blocker} is a file, not a folder")
    return value


def _existing(value: Path, info: ValidationInfo) -> Path:
    value = _resolve(value, info)
    if not value.exists():
        raise ValueError(f"no such file or folder: {value}")
    return value


InputPath = Annotated[Path, AfterValidator(_existing)]
"""A path that must exist when the plan is validated; relative to the plan's folder."""

OutputPath = Annotated[Path, AfterValidator(_output)]
"""A path to write to; relative to the plan's folder. It need not exist yet."""


Tokens = Annotated[int, Field(ge=1, le=1 << 24)]
"""A length in tokens (``max_length``, ``max_new_tokens``): at least 1, at most 16M, above any model's context.
Trainers also check a ``max_length`` against the model's ``max_position_embeddings`` before loading weights."""

LearningRate = Annotated[float, Field(gt=0, le=1)]
"""A learning rate: above 0 (0 trains nothing) and at most 1."""


class Reference:
    """Marks an option whose value names another part of the plan; the core checks it.

    ``kind`` is ``"stage"`` (an earlier ``[[stage]]`` by name) or ``"reward"`` (a
    ``[reward.<name>]`` table).
    """

    def __init__(self, kind: str):
        self.kind = kind

    def __repr__(self) -> str:
        return f"Reference({self.kind!r})"


StageRef = Annotated[str, Reference("stage")]
"""The name of an earlier stage, e.g. the reward-model stage a PPO stage scores with. The trainer
finds its output folder in ``ctx.outputs[name]``."""

RewardRef = Annotated[str, Reference("reward")]
"""The name of a plan's ``[reward.<name>]`` reward function; the trainer calls ``ctx.rewards[name]``."""


def references(annotation: object, metadata: list | tuple = ()) -> str | None:
    """The reference kind an option field holds (also inside ``list[...]`` and ``X | None``)."""
    import typing

    for m in metadata:
        if isinstance(m, Reference):
            return m.kind
    if typing.get_origin(annotation) is Annotated:
        found = references(None, annotation.__metadata__)
        if found:
            return found
    for arg in typing.get_args(annotation):
        found = references(arg)
        if found:
            return found
    return None
