"""Loading a half-precision checkpoint at float32 without holding the file and the model together.

transformers reads safetensors through a memory map and converts every tensor before the map is
closed, so the file's pages (half the fp32 model) and the fp32 model are resident together: 1.5x
the model at its peak (measured on Qwen2.5-0.5B's config). Loaded in its own dtype, the model's
tensors stay views of the map, untouched. :func:`upcast` then converts them one at a time and hands
each one's file pages back to the kernel (``madvise(MADV_DONTNEED)``: only whole pages of a tensor
already copied, which nothing reads again; the file itself is never written), so the peak is the
fp32 model plus one tensor.
"""

from __future__ import annotations

import ctypes
import mmap
from typing import Any

MADV_DONTNEED = 4


def file_mappings(suffix: str = ".safetensors") -> list[tuple[int, int]]:
    """``(start, end)`` of this process's mappings of files ending in ``suffix``. safetensors maps the
    file private and copy-on-write: a dropped page is read from the file again if ever touched."""
    out = []
    with open("/proc/self/maps", encoding="utf-8") as fh:
        for line in fh:
            fields = line.split()
            if len(fields) >= 6 and fields[5].endswith(suffix):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                out.append((start, end))
    return out


def release_pages(address: int, length: int, mappings: list[tuple[int, int]]) -> int:
    """Drop the whole pages of ``[address, address + length)`` from the resident set, if the range
    lies in one of ``mappings``; pages shared with a neighbouring tensor are kept. Returns bytes."""
    page = mmap.PAGESIZE
    start, end = -(-address // page) * page, (address + length) // page * page
    if end <= start or not any(lo <= address and address + length <= hi for lo, hi in mappings):
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED) != 0:
        return 0
    return end - start


def upcast(model: Any, dtype: Any) -> int:
    """Convert every floating parameter and buffer of ``model`` to ``dtype`` in place, one tensor at
    a time, releasing the file pages of those read from a memory-mapped checkpoint. Tied tensors stay
    tied. Returns the bytes of file pages released."""
    import torch

    try:
        mappings = file_mappings()
    except OSError:  # no /proc (not Linux): convert without releasing
        mappings = []
    done: dict[int, Any] = {}
    released = 0
    for module in model.modules():
        for table, is_param in ((module._parameters, True), (module._buffers, False)):
            for name, tensor in list(table.items()):
                if tensor is None or not tensor.is_floating_point() or tensor.dtype == dtype:
                    continue
                if id(tensor) not in done:
                    data = tensor.detach().to(dtype)
                    done[id(tensor)] = torch.nn.Parameter(data, requires_grad=tensor.requires_grad) if is_param \
                        else data
                    if mappings:
                        released += release_pages(tensor.data_ptr(), tensor.numel() * tensor.element_size(), mappings)
                table[name] = done[id(tensor)]
    model.config.dtype = dtype
    return released
