"""Quantizer ``fp8``: float8 (e4m3) weights in 128 x 128 blocks with an fp32 scale each, through transformers'
``finegrained_fp8`` integration as the model loads (``FineGrainedFP8Config``). It quantizes on CUDA or XPU
devices only; ``validate`` refuses it elsewhere with transformers' own reason."""

from __future__ import annotations

import math

from pydantic import Field

import ftcore
from ftcore_plugins.quantizers._base import QuantizerOptions, WeightQuantizer

# transformers/quantizers/quantizer_finegrained_fp8.py, validate_environment, quantizing a model on a CPU.
NO_GPU = "No GPU or XPU found. A GPU or XPU is needed for FP8 quantization."


class Fp8Quantizer(WeightQuantizer):
    """float8 e4m3 weights, block-scaled (transformers' finegrained_fp8; CUDA GPUs of compute capability 8.9
    or newer): train a peft adapter on the frozen base."""

    name = "fp8"
    bits = 8
    linear_only = "transformers' finegrained_fp8 integration quantizes linear layers only"

    class Options(QuantizerOptions):
        block_size: int = Field(128, ge=16)  # rows and columns sharing one scale

    def device_problems(self) -> list[str]:
        from ftcore_plugins.common.memory import gpu_visible

        return [] if gpu_visible() else [f"quantizer 'fp8' needs a CUDA GPU: transformers says \"{NO_GPU}\""]

    def quantization_config(self):
        from transformers import FineGrainedFP8Config

        b = self.options.block_size
        return FineGrainedFP8Config(weight_block_size=(b, b))

    def quantized_modules(self, model) -> list[str]:
        import torch

        return [path for path, m in model.named_modules()
                if getattr(getattr(m, "weight", None), "dtype", None) == torch.float8_e4m3fn]

    def packed_bytes(self, shape, scale_size: int) -> int:
        b = self.options.block_size
        return shape[0] * shape[1] + math.ceil(shape[0] / b) * math.ceil(shape[1] / b) * 4  # fp32 block scales


@ftcore.hookimpl
def register_quantizers(register):
    register(Fp8Quantizer)
