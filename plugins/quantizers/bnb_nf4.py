"""Quantizer ``bnb-nf4``: 4-bit NormalFloat weights (bitsandbytes), the QLoRA recipe."""

from __future__ import annotations

import ftcore

from ftcore_plugins.quantizers._bnb import FourBitQuantizer


class NF4Quantizer(FourBitQuantizer):
    """4-bit NF4 weights (bitsandbytes) for QLoRA: train a peft adapter on a frozen 4-bit base."""

    name = "bnb-nf4"
    quant_type = "nf4"


@ftcore.hookimpl
def register_quantizers(register):
    register(NF4Quantizer)
