"""Measured memory: process RSS and its peak from /proc, and CUDA memory when torch is
already loaded. Nothing here imports torch.

The peak is per step: ``reset_peak()`` clears the kernel's high-water mark (VmHWM) by
writing 5 to /proc/self/clear_refs, and CUDA's peak statistics when CUDA is in use.
"""

from __future__ import annotations

import glob
import os
import sys
from pathlib import Path
from typing import Any, Callable

MiB = 2**20
MADV_DONTNEED = 4  # Linux


def _status() -> dict[str, int]:
    """VmRSS, VmHWM and RssFile (the file-backed part of VmRSS) in bytes, from /proc/self/status
    (Linux)."""
    out = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def available_bytes() -> int | None:
    """Memory the system can give without swapping (MemAvailable of /proc/meminfo), or None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def release() -> None:
    """Collect garbage, and hand the heap's free pages back to the system (glibc's ``malloc_trim``):
    freed tensors below the allocator's mmap threshold otherwise stay resident, and what is loaded
    next (a model read back to check an export) is counted on top of them."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    name = ctypes.util.find_library("c")
    if name and sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(name).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
            pass


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
        now = _status().get("RssFile")
        if now is None:  # not Linux
            return
        if self.base is None or now < self.base:
            self.base = now
        elif now - self.base > self.limit:
            self.release()

    def release(self) -> None:
        for lo, hi in file_mappings(self.keep):
            release_pages(lo, hi - lo, [(lo, hi)])
        self.base = _status().get("RssFile")  # what stays (libraries' pages) is not counted again


def reset_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()


def snapshot() -> dict[str, Any]:
    """Current and peak memory in MiB (peak since the last ``reset_peak``)."""
    status = _status()
    out: dict[str, Any] = {}
    if "VmRSS" in status:
        out["rss_mib"] = round(status["VmRSS"] / MiB, 1)
        out["peak_rss_mib"] = round(status.get("VmHWM", status["VmRSS"]) / MiB, 1)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_allocated_mib"] = round(torch.cuda.memory_allocated() / MiB, 1)
        out["cuda_reserved_mib"] = round(torch.cuda.memory_reserved() / MiB, 1)
        out["cuda_peak_allocated_mib"] = round(torch.cuda.max_memory_allocated() / MiB, 1)
    return out


def gpu_visible() -> bool:
    """Whether this machine shows a CUDA/ROCm device (its device files), without importing torch."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd") or os.path.exists("/dev/dxg"))
