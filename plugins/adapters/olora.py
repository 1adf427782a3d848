"""Adapter ``olora``: LoRA initialised from a QR decomposition of each weight (peft)."""

from __future__ import annotations

import ftcore

from ftcore_plugins.adapters.lora import LoraAdapter


class OloraAdapter(LoraAdapter):
    """OLoRA (peft): the adapter starts as an orthonormal basis (QR) of each targeted weight, removed
    from the frozen base weight; often converges faster than LoRA."""

    name = "olora"

    def lora_kwargs(self):
        return {**super().lora_kwargs(), "init_lora_weights": "olora"}


@ftcore.hookimpl
def register_adapters(register):
    register(OloraAdapter)
