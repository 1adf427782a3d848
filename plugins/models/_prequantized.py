"""Checkpoints that ship quantized (a ``quantization_config`` in their config.json): which formats train here,
how the ``hf`` loader loads each, and what ``validate`` refuses before anything loads.

Measured on a CPU with tiny checkpoints made here (2026-11-29; transformers 5.24, peft 0.21, compressed-tensors
0.20): compressed-tensors (int and float, packed or not, from its own API and from llmcompressor's GPTQ), FP8
(``finegrained_fp8``) and gpt-oss's MXFP4 all load, train LoRA and merge once dequantized to the compute dtype.
Kept packed, compressed-tensors fails in three ways (an asymmetric packed checkpoint does not load; peft cannot
wrap a packed layer before its first forward; activation-quantized schemes pass no gradient through the base),
and on a CPU it unpacks every weight at the first forward anyway. FP8 and MXFP4 have no CPU kernel, and
transformers dequantizes them there by itself. So these three load dequantized, everywhere, and the run says so.

GPTQ and AWQ load as stored through gptqmodel (peft's ``GPTQLoraLinear`` and ``AwqLoraLinear``), as do
bitsandbytes checkpoints: LoRA trains on them, and peft cannot merge into them ("Cannot merge LORA layers when
the model is gptq quantized"), so only the adapter is exported.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

log = logging.getLogger("ftcore")

# quant_method -> (transformers' config class, why the weights are dequantized as they load)
DEQUANTIZED = {
    "compressed-tensors": ("CompressedTensorsConfig",
                           "kept packed, peft cannot wrap its layers before their first forward and a CPU unpacks "
                           "them at that forward anyway"),
    "fp8": ("FineGrainedFP8Config", "peft trains no LoRA on FP8Linear here, and transformers has no CPU kernel"),
    "mxfp4": ("Mxfp4Config", "no MXFP4 kernel trains here (transformers' needs Triton)"),
}
# quant_method -> (import names -> pip requirement) of the formats trained as stored
AS_STORED = {
    "gptq": {"gptqmodel": "gptqmodel", "optimum.gptq": "optimum"},
    "awq": {"gptqmodel": "gptqmodel"},
    "bitsandbytes": {"bitsandbytes": "bitsandbytes"},
}
MERGING_EXPORTS = ("merged", "onnx", "gguf")


def quantization(config: dict | None) -> dict | None:
    """The checkpoint's ``quantization_config`` (a language model's, or a VLM's text model's), or None."""
    if not isinstance(config, dict):
        return None
    q = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    return q if isinstance(q, dict) else None


def method(q: dict) -> str:
    return str(q.get("quant_method", "unknown")).lower()


def problems(config: dict | None, plan: Any, where: str) -> list[str]:
    """What ``validate`` refuses of a plan on a pre-quantized checkpoint (``where``: its config.json), one line
    each under ``path``."""
    q = quantization(config)
    if q is None:
        return []
    fmt = method(q)
    out = []
    if plan.quantizer.name != "none":
        out.append(f"{where} is already quantized ({fmt}); quantizer '{plan.quantizer.name}' would quantize it "
                   "again: use [quantizer] use = \"none\"")
    if fmt in DEQUANTIZED:
        return out
    if fmt not in AS_STORED:
        known = ", ".join([*DEQUANTIZED, *AS_STORED])
        return out + [f"{where} is quantized with {fmt}, which ftcore does not train on (it trains {known} "
                      "checkpoints); use the model's full-precision checkpoint and a [quantizer]"]
    missing = [req for module, req in AS_STORED[fmt].items() if not _installed(module)]
    if missing:
        out.append(f"{where} is a {fmt} checkpoint, which loads through {' and '.join(missing)}: "
                   f"pip install {' '.join(missing)}")
    for stage in plan.stages:
        if not getattr(stage.adapter.reg.cls, "peft", False):
            out.append(f"{where} holds {fmt} weights, which cannot be trained: stage '{stage.name}' uses adapter "
                       f"'{stage.adapter.name}'; train a peft adapter on them (adapter = \"lora\")")
    for export in plan.exports:
        if export.exporter.name in MERGING_EXPORTS:
            out.append(f"{where} holds {fmt} weights, which peft cannot merge an adapter into: [[export]] use = "
                       f"\"{export.exporter.name}\" is refused; export the adapter (use = \"adapter\"), or train on "
                       "the full-precision checkpoint")
    return out


def _installed(name: str) -> bool:
    """Whether a module is installed, found without importing it (a submodule's parent is imported: optimum-quanto
    alone provides an ``optimum`` package without ``optimum.gptq``, and transformers' GPTQ loader then fails on
    ``No module named 'optimum.gptq'``)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def load_kwargs(config: dict | None) -> dict:
    """``from_pretrained`` keywords for a pre-quantized checkpoint: the dequantizing config of the formats that
    load dequantized (said once in the log), else nothing (transformers reads the checkpoint's own)."""
    q = quantization(config)
    if q is None or method(q) not in DEQUANTIZED:
        return {}
    import transformers

    name, why = DEQUANTIZED[method(q)]
    log.info(f"model: the checkpoint's {method(q)} weights are dequantized to the compute dtype as they load: {why}")
    return {"quantization_config": getattr(transformers, name)(dequantize=True)}
