"""Memory helpers the plugins share: memory the system can still give, and handing the pages of
memory-mapped files back (a pass over a mapped corpus, a model's safetensors). Whether a GPU is visible, without
importing torch. The runner's own readings (RSS, peaks, ``release``) are :mod:`ftcore.memory`, re-exported
here."""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Callable

from ftcore.memory import MiB, release, reset_peak, snapshot, status

__all__ = ["MiB", "MappedPages", "available_bytes", "file_mappings", "gpu_visible", "release", "release_pages",
           "reset_peak", "snapshot", "status"]

MADV_DONTNEED = 4  # Linux


def gpu_visible() -> bool:
    """Whether this machine shows a CUDA/ROCm device (its device files), without importing torch."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd") or os.path.exists("/dev/dxg"))


def available_bytes() -> int | None:
    """Memory the system can give without swapping (MemAvailable of /proc/meminfo), or None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def file_mappings(keep: Callable[[str], bool]) -> list[tuple[int, int]]:
    """``(start, end)`` of this process's memory mappings of the files whose path ``keep`` accepts
    (from /proc/self/maps; none where it cannot be read)."""
    out = []
    try:
        lines = Path("/proc/self/maps").read_text(encoding="utf-8").splitlines()
    except OSError:
        return out
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and keep(fields[5].strip()):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            out.append((start, end))
    return out


def release_pages(address: int, length: int, mappings: list[tuple[int, int]]) -> int:
    """Drop the whole pages of ``[address, address + length)`` from the resident set
    (``madvise(MADV_DONTNEED)``), if the range lies in one of ``mappings`` of read-only or private
    file maps: a dropped page is read from the file again if ever touched, so nothing is lost. Pages
    shared with a neighbouring range are kept. Returns the bytes of the range advised."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    start, end = -(-address // page) * page, (address + length) // page * page
    if end <= start or not any(lo <= address and address + length <= hi for lo, hi in mappings):
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED) != 0:
        return 0
    return end - start


class MappedPages:
    """Keeps the resident pages of the memory-mapped files ``keep`` accepts to about ``limit``.

    A pass over a memory-mapped corpus keeps every page it touched resident, so RSS would grow
    with the corpus, although the pages are the file's (the kernel reads them again if ever
    needed). A pass calls :meth:`check` between its batches: when the process's file-backed
    resident memory (RssFile) has grown by ``limit`` since the last release, the pages of those
    mappings are handed back (:func:`release_pages`); :meth:`release` hands them back now.
    (Synchronous, not a watching thread: a pass through datasets can starve other threads of the
    GIL for seconds.)"""

    def __init__(self, keep: Callable[[str], bool], limit: int = 64 * MiB):
        self.keep, self.limit, self.base = keep, limit, None

    def check(self) -> None:
        now = status().get("RssFile")
        if now is None:  # not Linux
            return
        if self.base is None or now < self.base:
            self.base = now
        elif now - self.base > self.limit:
            self.release()

    def release(self) -> None:
        for lo, hi in file_mappings(self.keep):
            release_pages(lo, hi - lo, [(lo, hi)])
        self.base = status().get("RssFile")  # what stays (libraries' pages) is not counted again
