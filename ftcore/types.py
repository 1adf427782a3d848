"""Field types for component options that the core resolves for plugins: relative paths in a plan
resolve against the plan file's folder, whatever the current directory is (``path: InputPath``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, Field, ValidationInfo
from pydantic_core import PydanticCustomError

from .errors import unknown_choice


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


def _reference(kind: str) -> AfterValidator:
    """Checks a name against what the plan under validation defines: the validation context's ``stages``
    (the stages before the option's own) or ``rewards``. Outside a plan's validation there is none."""

    def check(value: str, info: ValidationInfo) -> str:
        known = (info.context or {}).get(kind)
        if known is None or value in known:
            return value
        if kind == "stages":
            where = f"earlier stages: {', '.join(known)}" if known else \
                "it must name a [[stage]] that runs before this one"
            raise PydanticCustomError("reference", f"no earlier stage is named {value!r}; {where}")
        message = unknown_choice("reward", value, known).replace("unknown reward", "undefined reward")
        raise PydanticCustomError("reference", f"{message} (define it as [reward.{value}])")

    return AfterValidator(check)


StageRef = Annotated[str, _reference("stages")]
"""The name of an earlier stage, e.g. the reward-model stage a PPO stage scores with. The trainer
finds its output folder in ``ctx.outputs[name]``."""

RewardRef = Annotated[str, _reference("rewards")]
"""The name of a plan's ``[reward.<name>]`` reward function; the trainer calls ``ctx.rewards[name]``."""
