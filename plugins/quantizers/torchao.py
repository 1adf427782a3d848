"""Quantizer ``torchao``: weight-only int8, int4 or float8 through torchao, as transformers loads the model
(``TorchAoConfig``); peft trains LoRA on the int8 weights (``peft/tuners/lora/torchao.py``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

import ftcore
from ftcore_plugins.quantizers._base import QuantizerOptions, WeightQuantizer, grouped_bytes

# What stops each type on this machine or under LoRA, in the libraries' own words (run on a CPU, torchao 0.18,
# peft 0.21, 2026-11-29). int8 runs everywhere.
CUDA_ONLY = {
    "int4": "torchao's int4 weight-only layouts run on CUDA only (\"plain\" needs the mslk kernels: \"Requires "
            "mslk >= 1.0.0\"; \"tile_packed_to_4d\" asks torch.cuda for the device's capability), and peft trains "
            "no LoRA on them yet (\"TorchaoLoraLinear only supports int8 weights for now\")",
    "float8": "torchao's float8 weight-only layout runs on CUDA GPUs of compute capability 8.9 or newer",
}


class TorchaoQuantizer(WeightQuantizer):
    """Weight-only quantization by torchao (int8 on any device; int4 and float8 on CUDA): train a peft
    adapter on the frozen base."""

    name = "torchao"
    packages = {"torchao": "torchao>=0.18"}
    linear_only = "torchao quantizes linear layers only"

    class Options(QuantizerOptions):
        weights: Literal["int8", "int4", "float8"] = "int8"  # int8: one byte a weight and a scale per row
        group_size: int = Field(128, ge=16)  # int4 only: weights sharing one scale and zero point

    @property
    def bits(self) -> int:  # type: ignore[override]
        return 4 if self.options.weights == "int4" else 8

    def device_problems(self) -> list[str]:
        from ftcore_plugins.common.memory import gpu_visible

        why = CUDA_ONLY.get(self.options.weights)
        return [f"quantizer 'torchao': weights = \"{self.options.weights}\": {why}; use weights = \"int8\" on "
                "this machine"] if why and not gpu_visible() else []

    def quantization_config(self):
        from torchao.quantization import Float8WeightOnlyConfig, Int4WeightOnlyConfig, Int8WeightOnlyConfig
        from transformers import TorchAoConfig

        o = self.options
        config = {"int8": Int8WeightOnlyConfig, "float8": Float8WeightOnlyConfig}.get(o.weights)
        return TorchAoConfig(config() if config else Int4WeightOnlyConfig(group_size=o.group_size))

    def quantized_modules(self, model) -> list[str]:
        from torchao.utils import TorchAOBaseTensor

        return [path for path, m in model.named_modules()
                if isinstance(getattr(m, "weight", None), TorchAOBaseTensor)]

    def packed_bytes(self, shape, scale_size: int) -> int:
        n = shape[0] * shape[1]
        if self.options.weights == "int4":  # a scale and a zero point per group
            return grouped_bytes(n, self.options.group_size, 4, 2 * scale_size)
        return n + shape[0] * (4 if self.options.weights == "float8" else scale_size)  # a scale per row


@ftcore.hookimpl
def register_quantizers(register):
    register(TorchaoQuantizer)
