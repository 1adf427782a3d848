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

from typing import Any

from ftcore_plugins.common.memory import file_mappings, release_pages


def upcast(model: Any, dtype: Any) -> int:
    """Convert every floating parameter and buffer of ``model`` to ``dtype`` in place, one tensor at
    a time, releasing the file pages of those read from a memory-mapped checkpoint. Tied tensors stay
    tied. Returns the bytes of file pages released."""
    import torch

    # safetensors maps the file private and copy-on-write; none where /proc cannot be read (not Linux)
    mappings = file_mappings(lambda path: path.endswith(".safetensors"))
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
