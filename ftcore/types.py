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

from pydantic import AfterValidator, ValidationInfo


def _resolve(value: Path, info: ValidationInfo) -> Path:
    base = (info.context or {}).get("base_dir")
    try:
        value = value.expanduser()
    except RuntimeError as exc:  # "~nosuchuser/..."
        raise ValueError(f"cannot expand {str(value)!r}: {exc}") from None
    if base is not None and not value.is_absolute():
        value = Path(base) / value
    return Path(str(value.resolve()) if base is not None else value)


def _existing(value: Path, info: ValidationInfo) -> Path:
    value = _resolve(value, info)
    if not value.exists():
        raise ValueError(f"no such file or folder: {value}")
    return value


InputPath = Annotated[Path, AfterValidator(_existing)]
"""A path that must exist when the plan is validated; relative to the plan's folder."""

OutputPath = Annotated[Path, AfterValidator(_resolve)]
"""A path to write to; relative to the plan's folder. It need not exist yet."""
