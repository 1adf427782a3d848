"""Adapter ``dora``: weight-decomposed LoRA (DoRA) through peft."""

from __future__ import annotations

import ftcore

from ftcore_plugins.adapters.lora import LoraAdapter


class DoraAdapter(LoraAdapter):
    """DoRA (peft): LoRA on the direction of each weight plus a trained magnitude vector."""

    name = "dora"

    def lora_kwargs(self):
        return {**super().lora_kwargs(), "use_dora": True}


@ftcore.hookimpl
def register_adapters(register):
    register(DoraAdapter)
