"""Adapter ``loftq``: LoRA initialised by LoftQ, which quantizes each weight and starts the adapter
on the quantization error (peft)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

import ftcore
from ftcore.errors import FtcoreError

from ftcore_plugins.adapters.lora import LoraAdapter, LoraOptions


def loftq_unavailable() -> str | None:
    """Why peft's LoftQ initialisation cannot run here, or None. It quantizes with bitsandbytes on a
    CUDA (or XPU) device (``peft.utils.loftq_utils.loftq_init``), whatever device the model is on."""
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        return ("adapter 'loftq' needs bitsandbytes (pip install bitsandbytes): peft's LoftQ quantizes each "
                "targeted weight with it")
    import torch

    if not (torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())):
        return ("adapter 'loftq' needs a CUDA (or XPU) GPU: peft's LoftQ initialisation quantizes the weights with "
                "bitsandbytes on the GPU, and none is visible here; on a CPU use adapter \"pissa\" or \"lora\"")
    return None


class LoftqAdapter(LoraAdapter):
    """LoftQ (peft): each targeted weight is replaced by its NF4 (or int8) quantized-then-dequantized
    value Q, and the adapter starts so that Q + BA approximates the original weight."""

    name = "loftq"
    full_precision_base = True  # peft's LoftQ quantizes full-precision weights itself

    class Options(LoraOptions):
        loftq_bits: Literal[4, 8] = 4
        loftq_iter: int = Field(1, ge=1)

    def check(self, plan):
        problems = super().check(plan)
        why = loftq_unavailable()
        return problems + ([why] if why else [])

    def lora_kwargs(self):
        from peft import LoftQConfig

        return {**super().lora_kwargs(), "init_lora_weights": "loftq",
                "loftq_config": LoftQConfig(loftq_bits=self.options.loftq_bits, loftq_iter=self.options.loftq_iter)}

    def apply(self, model, ctx):
        why = loftq_unavailable()  # validated where the plan was checked; this is where it runs
        if why:
            raise FtcoreError(why)
        return super().apply(model, ctx)

    def restore(self, base, path, ctx):
        why = loftq_unavailable()  # peft recomputes the quantized base weights on loading
        if why:
            raise FtcoreError(why)
        return super().restore(base, path, ctx)


@ftcore.hookimpl
def register_adapters(register):
    register(LoftqAdapter)
