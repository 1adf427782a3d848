"""Where ftcore caches derived data (tokenized datasets), shared by every run.

``FTCORE_CACHE_DIR`` sets it; otherwise ``$XDG_CACHE_HOME/ftcore`` or ``~/.cache/ftcore``.
It lives outside run directories so several runs reuse it; ``ftcore cache clear`` empties it.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    if os.environ.get("FTCORE_CACHE_DIR"):
        return Path(os.environ["FTCORE_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ftcore"
