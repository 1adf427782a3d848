"""What the tracker plugins share: where they write, which values are numbers, and the check that
their library is installed."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

PIP_EXTRA = "pip install 'ftcore[track]'"


def missing(modules: tuple[str, ...], pip: str) -> list[str]:
    """``check(plan)`` problems for libraries that are not installed: found without importing them,
    so validating a plan stays fast."""
    absent = [m for m in modules if importlib.util.find_spec(m) is None]
    if not absent:
        return []
    return [f"needs {', '.join(absent)}, which is not installed: pip install {pip} (or {PIP_EXTRA})"]


def folder(run: Any, chosen: Path | None, tool: str) -> Path:
    path = chosen or run.run_dir / "tracking" / tool
    path.mkdir(parents=True, exist_ok=True)
    return path


def numbers(metrics: dict[str, Any]) -> dict[str, float]:
    """The numeric values; the reporter writes NaN and infinities as strings, so turn them back."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, (int, float)):
            out[key] = float(value)
        elif value in ("nan", "inf", "-inf"):
            out[key] = float(value)
    return out


def finite(value: float) -> bool:
    return not (math.isnan(value) or math.isinf(value))


def error_line(error: BaseException) -> str:
    first = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first}"[:500]
