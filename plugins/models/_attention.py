"""The ``attn_implementation`` option the model loaders share: which attention kernel transformers
runs, and the one-line refusal of a kernel this machine cannot run (checked by ``ftcore validate``
without importing torch)."""

from __future__ import annotations

import importlib.util
from typing import Literal

from ftcore_plugins.common.memory import gpu_visible

# transformers' names. sdpa is its default where the model supports it; flex_attention compiles
# a kernel with torch.compile; the flash kernels are CUDA-only packages. With packing, sft sends
# position ids and no mask: flash_attention_2/3 then take their varlen path, and sdpa/eager/flex
# get a block-diagonal mask from transformers, so no sample attends to another.
Attention = Literal["sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3"]

PACKAGES = {"flash_attention_2": ("flash_attn", "flash-attn"), "flash_attention_3": ("flash_attn_interface",
                                                                                      "flash-attn 3 (hopper build)")}


def attention_problem(value: str | None) -> str | None:
    """Why ``attn_implementation = value`` cannot run here, or None."""
    if value not in PACKAGES:
        return None
    if not gpu_visible():
        return (f"attn_implementation: {value} needs a CUDA GPU and none is visible here; "
                "use \"sdpa\" (the default) or \"eager\"")
    module, package = PACKAGES[value]
    if importlib.util.find_spec(module) is None:
        return f"attn_implementation: {value} needs the {package} package, which is not installed"
    return None
