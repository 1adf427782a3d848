"""What every weight quantizer shares (bitsandbytes, torchao, Quanto, HQQ, FP8): the plan checks,
``load_kwargs()`` for the ones transformers quantizes while it loads, and the preparation of the
loaded model for a peft adapter to train on its frozen, quantized weights.

A quantizer subclass says how its weights are made (``quantization_config()`` for transformers'
load-time quantizers, or ``quantize(model)`` after loading), which modules hold them
(``quantized_modules``) and, for ``ftcore estimate``, what a weight costs (``packed_bytes``).
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
from typing import Any, ClassVar

from ftcore.component import Component, Options
from ftcore.errors import FtcoreError
from ftcore_plugins.common.model import checkpointing_on

log = logging.getLogger("ftcore")

# Model loaders that build their model from a config rather than loading a checkpoint:
# there is nothing pretrained to quantize, and every weight must train.
NOT_QUANTIZABLE = {"scratch": "it builds a randomly initialised model whose every weight must train"}


class QuantizerOptions(Options):
    """Options every weight quantizer takes."""

    gradient_checkpointing: bool = True  # non-reentrant, turned on by prepare(); off trades memory for speed


class WeightQuantizer(Component):
    """Base of the quantizers that store a pretrained model's linear weights in fewer bits, frozen, for
    a peft adapter to train on. Subclasses set ``name``, ``Options``, ``bits`` and ``packages``."""

    Options = QuantizerOptions
    bits: ClassVar[float] = 4  # bits per stored weight, for messages ("4-bit weights")
    # Import name -> pip requirement of the libraries it needs; checked at validate without importing them.
    packages: ClassVar[dict[str, str]] = {}

    @property
    def weights(self) -> str:
        """``4-bit``, ``8-bit``: how messages name the stored weights."""
        return f"{self.bits:g}-bit"

    # -- before anything loads -------------------------------------------------------------
    def check(self, plan: Any) -> list[str]:
        problems = [f"quantizer '{self.name}' needs the {module} package: pip install '{req}'"
                    for module, req in self.packages.items() if importlib.util.find_spec(module) is None]
        problems += self.device_problems()
        loader = plan.model.name
        if loader in NOT_QUANTIZABLE:
            problems.append(f"quantizer '{self.name}' cannot quantize [model] use = \"{loader}\": "
                            f"{NOT_QUANTIZABLE[loader]}; quantize a pretrained checkpoint with "
                            "[model] use = \"hf\", or use [quantizer] use = \"none\"")
        previous = None
        for stage in plan.stages:
            adapter = stage.adapter
            if not getattr(adapter.reg.cls, "peft", False):
                problems.append(f"stage '{stage.name}' uses adapter '{adapter.name}', which trains the base weights; "
                                f"{self.weights} weights cannot be trained, so train a peft adapter on them "
                                "(adapter = \"lora\"), or use [quantizer] use = \"none\"")
            elif previous is not None and getattr(previous.reg.cls, "peft", False) and not (
                    previous.reg is adapter.reg and previous.options == adapter.options):
                problems.append(f"stage '{stage.name}' changes the adapter, which would merge the previous one into "
                                f"the {self.weights} base weights (re-quantizing them rounds away much of the "
                                "update); give every stage the same adapter, or use [quantizer] use = \"none\"")
            previous = adapter
        # No export check: the merging exporters (merged, onnx) fold the adapter into the base loaded again
        # at full precision, never into the quantized weights.
        return problems

    def device_problems(self) -> list[str]:
        """What stops these options on this machine, in the library's own words (none by default)."""
        return []

    # -- loading ---------------------------------------------------------------------------
    def quantization_config(self) -> Any:
        """transformers' ``quantization_config`` for ``from_pretrained``, or None when :meth:`quantize`
        quantizes the loaded model instead."""
        return None

    def load_kwargs(self) -> dict:
        config = self.quantization_config()
        if config is None:
            return {}
        kwargs: dict[str, Any] = {"quantization_config": config}
        device_map = _device_map()
        if device_map is not None:
            kwargs["device_map"] = device_map
        return kwargs

    def quantize(self, model: Any) -> Any:
        """Quantize a model loaded at full precision; the load-time quantizers have nothing left to do."""
        return model

    def quantized_modules(self, model: Any) -> list[str]:  # pragma: no cover - overridden
        """Paths of the modules whose weights this quantizer stores."""
        raise NotImplementedError

    def prepare(self, model):
        """Quantize (where loading did not), check something was, then freeze every base weight, turn on
        non-reentrant gradient checkpointing and turn off the KV cache; trainable parameters are kept in
        fp32 through training (:func:`keep_trainable_fp32`)."""
        model = self.quantize(model)
        self.verify(model)
        self.freeze(model)
        # A KV cache is useless in training and conflicts with checkpointing. generate() still
        # uses one: it follows generation_config.use_cache, not config.use_cache.
        model.config.use_cache = False
        keep_trainable_fp32(model)
        line = self.unquantized_experts(model)
        if line:
            log.info(line)
        return model

    def verify(self, model) -> None:
        """Refuse a model in which nothing came out quantized (a loader that dropped ``load_kwargs()``, a family
        whose layers the library does not convert), else log how many layers were."""
        quantized = self.quantized_modules(model)
        if not quantized:
            model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
            raise FtcoreError(f"quantizer '{self.name}' quantized no layer of this {model_type} model; use a loader "
                              "that passes load_kwargs() to from_pretrained, such as [model] use = \"hf\", or "
                              "[quantizer] use = \"none\" to train at full precision")
        log.info(f"quantizer '{self.name}': {len(quantized)} layers hold {self.weights} weights")

    def freeze(self, model) -> None:
        """Every base weight frozen, left in the model's dtype (as TRL's SFTTrainer leaves them), and
        non-reentrant checkpointing on: gradients reach the adapters inside a block whose input needs
        none (peft adds its input-grad hook for reentrant checkpointing only)."""
        for p in model.parameters():
            p.requires_grad_(False)
        if self.options.gradient_checkpointing:
            checkpointing_on(model)

    def unquantized_experts(self, model: Any, *, counted: bool = False) -> str | None:
        """One line on a mixture-of-experts model's routed experts stored as 3-D parameters, which stay at full
        precision: the quantizers here replace or convert linear layers only. ``counted``: worded for
        ``ftcore estimate``."""
        from ftcore_plugins.common.experts import expert_parameters

        experts = expert_parameters(model)
        if not experts:
            return None
        n = sum(p.numel() for p in experts.values())
        size = sum(p.numel() * p.element_size() for p in experts.values())
        dtypes = ", ".join(sorted({str(p.dtype).replace("torch.", "") for p in experts.values()}))
        return (f"quantizer '{self.name}': the routed experts ({n:,} parameters in {len(experts)} tensors, "
                f"{size / 2**30:.2f} GiB) stay in {dtypes}" + (", and are counted so" if counted else "")
                + f": {self.linear_only}")

    linear_only: ClassVar[str] = "it quantizes linear layers only"

    # -- ftcore estimate (optional; see plugins/commands/estimate.py) -------------------------
    def packed_bytes(self, weight_shape: tuple[int, ...]) -> int:  # pragma: no cover - overridden
        """Bytes one quantized weight of this shape is stored in, its scales and zero points included."""
        raise NotImplementedError

    def prepare_meta(self, model, *, device: str = "cpu"):
        self.freeze(model)  # what prepare() does to trainability and checkpointing; the packed bytes: weight_bytes
        model.config.use_cache = False
        return model

    def weight_bytes(self, model) -> int:
        from ftcore_plugins.common.estimate import packed_weight_bytes

        return packed_weight_bytes(model, self.packed_bytes, self.estimate_skip())

    def step_bytes(self, model, *, device: str = "cpu", tokens: int = 0) -> int:
        from ftcore_plugins.common.estimate import dequantized_step_bytes

        return dequantized_step_bytes(model, self.estimate_skip(), device=device, tokens=tokens)

    def estimate_skip(self) -> list[str]:
        """Module names the options keep unquantized, as ``ftcore estimate`` should count them."""
        return []

    def weight_notes(self, model) -> list[str]:
        line = self.unquantized_experts(model, counted=True)
        return [line] if line else []


def grouped_bytes(n: int, group_size: int, bits: float, per_group: int) -> int:
    """``n`` weights at ``bits`` each, plus ``per_group`` bytes of scale and zero point per group."""
    return math.ceil(n * bits / 8) + math.ceil(n / group_size) * per_group


def keep_trainable_fp32(model) -> None:
    """Keep trainable parameters (the adapter) in fp32 while training a quantized model.

    peft creates LoRA weights on a k-bit base in fp32 (``autocast_adapter_dtype=True``), but
    TRL's trainers cast every trainable parameter of a quantized model to bf16 when they are
    constructed. bf16 cannot hold the small updates of a low learning rate, so adapters would
    stop learning; the QLoRA recipe keeps them in fp32 (the compute dtype only applies to the
    k-bit matmuls). A forward pre-hook on the decoder (transformers' ``base_model``, which
    every forward reaches through ``__call__``; peft's wrappers call ``forward`` directly and
    skip hooks on the outer model) casts them back before the first training step, so
    gradients and optimizer state are fp32 too.
    """
    import torch

    def upcast(module, args):
        if not module.training:
            return
        for p in model.parameters():
            if p.requires_grad and p.dtype in (torch.float16, torch.bfloat16):
                p.data = p.data.to(torch.float32)

    # Not the input embeddings: a template that adds tokens replaces that module after prepare().
    decoder = getattr(model, "base_model", None)
    decoder = model if decoder is None else decoder
    if not getattr(decoder, "_ftcore_keep_fp32", False):
        decoder.register_forward_pre_hook(upcast)
        decoder._ftcore_keep_fp32 = True


def compute_dtype(name: str):
    """``auto``: bf16 on a CUDA GPU that supports it (as the trainers' ``precision = "auto"``), else fp32."""
    import torch

    if name == "auto":
        cuda = torch.cuda.is_available()
        return torch.bfloat16 if cuda and torch.cuda.is_bf16_supported() else torch.float32
    return getattr(torch, name)


def _device_map() -> dict | None:
    """One whole model per process on its own GPU under torchrun/accelerate (DDP); otherwise
    transformers places a quantized model on the current device (or the CPU) by itself."""
    import torch

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and torch.cuda.is_available():
        return {"": int(os.environ.get("LOCAL_RANK", "0"))}
    return None
