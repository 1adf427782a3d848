"""Quantizer ``hqq``: Half-Quadratic Quantization (1 to 8 bits, no calibration data) of every linear layer
but the output head, done after the model loads; peft trains LoRA on hqq's layers (``peft/tuners/lora/hqq.py``).

transformers 5.24 cannot quantize with HQQ while it loads ("QuantizationMethod.HQQ is not available yet and
will be supported soon", ``transformers/quantizers/base.py``), so ``prepare()`` replaces each ``nn.Linear``
with hqq's own ``HQQLinear``, which quantizes the weight it is given.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field

import ftcore
from ftcore_plugins.quantizers._base import QuantizerOptions, WeightQuantizer, grouped_bytes


class HqqQuantizer(WeightQuantizer):
    """HQQ weights (hqq's HQQLinear, 1 to 8 bits, no calibration data): train a peft adapter on the frozen base."""

    name = "hqq"
    packages = {"hqq": "hqq>=0.2.8"}
    linear_only = "hqq quantizes linear layers only"

    class Options(QuantizerOptions):
        nbits: Literal[1, 2, 3, 4, 8] = 4
        group_size: int = Field(64, ge=8)  # weights sharing one scale and zero point
        axis: Literal[0, 1] = 1  # the axis groups run along; hqq's fast kernels want 1

    @property
    def bits(self) -> int:  # type: ignore[override]
        return self.options.nbits

    def quantize(self, model):
        import torch
        from hqq.core.quantize import BaseQuantizeConfig, HQQLinear

        from ftcore_plugins.common.estimate import convertible_linears

        o = self.options
        config = BaseQuantizeConfig(nbits=o.nbits, group_size=o.group_size, axis=o.axis)
        # HQQLinear.to() does nothing, so the weights are quantized where they will train.
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if torch.cuda.is_available() else "cpu"
        for path, linear in convertible_linears(model, []).items():
            if type(linear) is not torch.nn.Linear:  # another library's layer (already quantized, or its own)
                continue
            parent, _, child = path.rpartition(".")
            layer = HQQLinear(linear, config, compute_dtype=linear.weight.dtype, device=device, del_orig=True)
            setattr(model.get_submodule(parent), child, layer)
        return model

    def quantized_modules(self, model) -> list[str]:
        from hqq.core.quantize import HQQLinear

        return [path for path, m in model.named_modules() if isinstance(m, HQQLinear)]

    def packed_bytes(self, shape, scale_size: int) -> int:
        # 3-bit packs ten weights into an int32 (3.2 bits each); a scale and a zero point per group.
        bits = 3.2 if self.options.nbits == 3 else self.options.nbits
        return grouped_bytes(shape[0] * shape[1], self.options.group_size, bits, 2 * scale_size)


@ftcore.hookimpl
def register_quantizers(register):
    register(HqqQuantizer)
