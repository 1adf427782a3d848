"""Measured memory, as the runner records it at each step: process RSS and its peak from /proc, and
CUDA memory when torch is already loaded; and handing freed heap back to the system. Nothing here
imports torch; the plugins' memory helpers are in ``ftcore_plugins.common.memory``. The peak is per
step: ``reset_peak()`` clears the kernel's high-water mark (VmHWM) and CUDA's peak statistics."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

MiB = 2**20


def status() -> dict[str, int]:
    """VmRSS, VmHWM and RssFile (its file-backed part) in bytes, from /proc/self/status (Linux)."""
    out = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


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


def keep_alive_objects() -> None:
    """Take every object alive now out of the garbage collector's sight (``gc.freeze``): with torch and
    transformers imported that is half a million objects, which each full collection walks, 0.5 s apiece
    on a 2-core machine (``release`` runs one at every step; Python runs more as data is tokenized). Called
    before a model loads: what is alive then (the imported libraries, the plan) lives to the end anyway,
    and the model and everything made after it stay collectable."""
    import gc

    gc.collect()
    gc.freeze()


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
    now = status()
    out: dict[str, Any] = {}
    if "VmRSS" in now:
        out["rss_mib"] = round(now["VmRSS"] / MiB, 1)
        out["peak_rss_mib"] = round(now.get("VmHWM", now["VmRSS"]) / MiB, 1)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_allocated_mib"] = round(torch.cuda.memory_allocated() / MiB, 1)
        out["cuda_reserved_mib"] = round(torch.cuda.memory_reserved() / MiB, 1)
        out["cuda_peak_allocated_mib"] = round(torch.cuda.max_memory_allocated() / MiB, 1)
    return out

