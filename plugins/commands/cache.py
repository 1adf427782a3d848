"""``ftcore cache``: show or clear the tokenized-data cache that runs share."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import ftcore
from ftcore_plugins.common.cache import cache_dir
from ftcore.command import Command


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


class CacheCommand(Command):
    """Show or clear the tokenized-data cache.

    The cache of tokenized datasets that runs share (FTCORE_CACHE_DIR, default ~/.cache/ftcore).
    """

    name = "cache"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("action", choices=("info", "clear"), nargs="?", default="info")

    def run(self, args: argparse.Namespace) -> int:
        path = cache_dir()
        if args.action == "clear":
            print(f"cleared {path}: freed {clear(path) / 2**20:.1f} MiB")
        else:
            files, total = size(path) if path.exists() else (0, 0)
            print(f"{path}: {files} files, {total / 2**20:.1f} MiB")
        return 0


@ftcore.hookimpl
def register_commands(register):
    register(CacheCommand)
