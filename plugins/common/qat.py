"""Quantization-aware training through torchao (``qat`` on an ``sft`` stage): one scheme, shared by the
trainer, which trains with the linear layers' weights fake-quantized to it (torchao's ``QATConfig`` prepare
step), and the ``torchao`` exporter, which quantizes the trained model to the same scheme for real.

The schemes are the torchao base configs whose QAT runs on a CPU as well as on CUDA (torchao 0.18,
``_infer_fake_quantize_configs``): ``IntxWeightOnlyConfig`` (int4/int8 weights in groups, symmetric), with
``activations = "int8"`` ``Int8DynamicActivationIntxWeightConfig``. ``Int4WeightOnlyConfig``'s QAT is
CUDA-only (its layouts need mslk on a CPU). A model quantized with the scheme computes exactly what the
fake-quantized model computed (a difference of 0 on a tiny Llama, tests/test_qat.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from ftcore.component import Options


class QatOptions(Options):
    """``qat = { weights = "int4", group_size = 32 }``: the quantization the trained model is meant for."""

    weights: Literal["int4", "int8"] = "int4"  # symmetric integer weights
    group_size: int = Field(32, ge=8)  # weights sharing one scale, along each row; must divide every layer's input
    activations: Literal["none", "int8"] = "none"  # int8: activations quantized per token as the model runs

    def describe(self) -> str:
        acts = ", int8 dynamic activations" if self.activations == "int8" else ""
        return f"{self.weights} weights in groups of {self.group_size}{acts}"


def base_config(options: QatOptions) -> Any:
    """torchao's post-training config of the scheme: what QAT fake-quantizes to, and what the export applies."""
    import torch
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerGroup

    dtype, groups = (torch.int4 if options.weights == "int4" else torch.int8), PerGroup(options.group_size)
    if options.activations == "int8":
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=dtype, weight_granularity=groups)
    return IntxWeightOnlyConfig(weight_dtype=dtype, granularity=groups)


def plan_qat(plan: Any) -> tuple[str, QatOptions] | None:
    """The last stage that trains with ``qat``, and its scheme: the one the run's model is trained for."""
    found = None
    for stage in plan.stages:
        qat = getattr(stage.trainer.options, "qat", None)
        if qat is not None:
            found = (stage.name, qat)
    return found
