"""How every table ftcore prints or writes shows a value. The end-of-run tables themselves are a built-in
plugin's (``ftcore_plugins.commands.report`` implements ``ftcore_run_summary``)."""

from __future__ import annotations

from typing import Any


def format_value(v: Any) -> str:
    """How every table ftcore prints or writes shows a value: floats to 4 significant digits, None blank."""
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)
