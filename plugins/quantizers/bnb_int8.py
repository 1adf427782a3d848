"""Quantizer ``bnb-int8``: 8-bit weights (bitsandbytes LLM.int8(), outliers kept in fp16)."""

from __future__ import annotations

from pydantic import Field

import ftcore
from ftcore_plugins.quantizers._bnb import BnbOptions, BnbQuantizer


class Int8Quantizer(BnbQuantizer):
    """8-bit LLM.int8() weights (bitsandbytes): train a peft adapter on a frozen 8-bit base."""

    name = "bnb-int8"
    bits = 8

    class Options(BnbOptions):
        llm_int8_threshold: float = Field(6.0, ge=0)  # activations above this go through an fp16 outlier matmul

    def bnb_config(self):
        from transformers import BitsAndBytesConfig

        o = self.options
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=o.llm_int8_threshold)


@ftcore.hookimpl
def register_quantizers(register):
    register(Int8Quantizer)
