"""Quantizer ``bnb-fp4``: 4-bit floating-point weights (bitsandbytes)."""

from __future__ import annotations

import ftcore

from ftcore_plugins.quantizers._bnb import FourBitQuantizer


class FP4Quantizer(FourBitQuantizer):
    """4-bit FP4 weights (bitsandbytes); NF4 is usually more accurate for normally distributed weights."""

    name = "bnb-fp4"
    quant_type = "fp4"


@ftcore.hookimpl
def register_quantizers(register):
    register(FP4Quantizer)
