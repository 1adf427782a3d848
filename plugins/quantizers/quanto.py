"""Quantizer ``quanto``: int8, int4 or int2 weights through optimum-quanto, as transformers loads the model
(``QuantoConfig``). Its ``QLinear`` is an ``nn.Linear``, so peft's own LoRA layer wraps it; it runs on a CPU."""

from __future__ import annotations

from typing import Literal

import ftcore
from ftcore_plugins.quantizers._base import QuantizerOptions, WeightQuantizer, grouped_bytes


def group_size(in_features: int) -> int | None:
    """Quanto's group for int4/int2 weights (``optimum/quanto/nn/qmodule.py``): 128, else 96, 64 or 32, the
    first that divides a row longer than 128; None (a scale and shift per row) otherwise."""
    if in_features <= 128:
        return None
    return next((g for g in (128, 96, 64, 32) if in_features % g == 0), None)


class QuantoQuantizer(WeightQuantizer):
    """int8/int4/int2 weights by optimum-quanto: train a peft adapter on the frozen base."""

    name = "quanto"
    packages = {"optimum.quanto": "optimum-quanto>=0.2.7"}
    linear_only = "quanto quantizes linear layers only"

    class Options(QuantizerOptions):
        weights: Literal["int8", "int4", "int2"] = "int8"  # int8: a scale per row; int4/int2: per group

    @property
    def bits(self) -> int:  # type: ignore[override]
        return int(self.options.weights[3:])

    def quantization_config(self):
        from transformers import QuantoConfig

        return QuantoConfig(weights=self.options.weights)

    def quantized_modules(self, model) -> list[str]:
        from optimum.quanto import QModuleMixin

        return [path for path, m in model.named_modules()
                if isinstance(m, QModuleMixin) and getattr(m, "weight_qtype", None) is not None]

    def packed_bytes(self, shape, scale_size: int) -> int:
        n = shape[0] * shape[1]
        if self.bits == 8:
            return n + shape[0] * scale_size  # a scale per output row
        group = group_size(shape[1]) or shape[1]
        return grouped_bytes(n, group, self.bits, 2 * scale_size)  # a scale and a shift per group


@ftcore.hookimpl
def register_quantizers(register):
    register(QuantoQuantizer)
