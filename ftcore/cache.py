"""Where ftcore caches derived data (tokenized datasets), shared by every run.

``FTCORE_CACHE_DIR`` sets it; otherwise ``$XDG_CACHE_HOME/ftcore`` or ``~/.cache/ftcore``.
It lives outside run directories so several runs reuse it; ``ftcore cache clear`` empties it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def cache_dir() -> Path:
    if os.environ.get("FTCORE_CACHE_DIR"):
        return Path(os.environ["FTCORE_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ftcore"


def size(path: Path) -> tuple[int, int]:
    """(files, bytes) under ``path``."""
    files = total = 0
    for p in path.rglob("*"):
        if p.is_file():
            files += 1
            total += p.stat().st_size
    return files, total


def clear(path: Path) -> int:
    """Remove the cache's entries; returns the bytes freed. Only ftcore's own folders go."""
    freed = 0
    for child in ("tokenized",):
        target = path / child
        if target.exists():
            freed += size(target)[1]
            shutil.rmtree(target)
    return freed
