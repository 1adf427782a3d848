"""Adapter ``rslora``: rank-stabilised LoRA through peft (scaling ``lora_alpha / sqrt(r)``)."""

from __future__ import annotations

import ftcore

from ftcore_plugins.adapters.lora import LoraAdapter, LoraCommonOptions


class RsloraAdapter(LoraAdapter):
    """rsLoRA (peft): LoRA scaled by lora_alpha / sqrt(r) rather than lora_alpha / r."""

    name = "rslora"
    Options = LoraCommonOptions

    def lora_kwargs(self):
        return {"use_rslora": True}


@ftcore.hookimpl
def register_adapters(register):
    register(RsloraAdapter)
