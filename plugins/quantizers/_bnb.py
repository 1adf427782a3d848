"""What the bitsandbytes quantizers (``bnb-nf4``, ``bnb-fp4``, ``bnb-int8``) share: the
plan checks, ``load_kwargs()`` and the QLoRA preparation of the loaded model.

The weights are quantized as transformers loads them (``quantization_config``), so only a
model loader that passes ``load_kwargs()`` to ``from_pretrained`` can use these quantizers:
``hf`` does; ``scratch`` builds a random model from a config and is refused (see
:meth:`BnbQuantizer.check`). ``prepare()`` checks that the weights really came out quantized,
so a third-party loader that drops ``load_kwargs()`` fails at once, not after training.
"""

from __future__ import annotations

import logging
import os
from typing import Any, ClassVar, Literal

from ftcore.component import Component, Options
from ftcore.errors import FtcoreError

log = logging.getLogger("ftcore")

DTYPES = ("auto", "float32", "bfloat16", "float16")

# Model loaders that build their model from a config rather than loading a checkpoint:
# there is nothing pretrained to quantize, and every weight must train.
NOT_QUANTIZABLE = {"scratch": "it builds a randomly initialised model whose every weight must train"}

class BnbOptions(Options):
    """Options every bitsandbytes quantizer takes (transformers' ``BitsAndBytesConfig`` names)."""

    gradient_checkpointing: bool = True  # non-reentrant, turned on by prepare(); off trades memory for speed
    fp32_non_quantized: bool | None = None  # norms, embeddings, LM head in fp32; unset: the device's (CPU yes, CUDA no)


class BnbQuantizer(Component):
    """Base of the bitsandbytes quantizers; subclasses set ``name``, ``bits`` and ``Options``."""

    bits: ClassVar[int] = 4
    Options = BnbOptions

    # -- before anything loads -------------------------------------------------------------
    def check(self, plan: Any) -> list[str]:
        bits = f"{self.bits}-bit"
        problems = []
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
                                f"{bits} weights cannot be trained, so train a peft adapter on them "
                                "(adapter = \"lora\"), or use [quantizer] use = \"none\"")
            elif previous is not None and getattr(previous.reg.cls, "peft", False) and not (
                    previous.reg is adapter.reg and previous.options == adapter.options):
                problems.append(f"stage '{stage.name}' changes the adapter, which would merge the previous one into "
                                f"the {bits} base weights (re-quantizing them rounds away much of the update); "
                                "give every stage the same adapter, or use [quantizer] use = \"none\"")
            previous = adapter
        # No export check: the merging exporters (merged, onnx) fold the adapter into the base loaded again
        # at full precision, never into the quantized weights.
        return problems

    # -- loading ---------------------------------------------------------------------------
    def bnb_config(self):  # pragma: no cover - overridden
        raise NotImplementedError

    def load_kwargs(self) -> dict:
        kwargs: dict[str, Any] = {"quantization_config": self.bnb_config()}
        device_map = _device_map()
        if device_map is not None:
            kwargs["device_map"] = device_map
        return kwargs

    def prepare(self, model):
        """QLoRA preparation: every base weight frozen, non-reentrant gradient checkpointing, no KV
        cache; the non-quantized weights in fp32 or left in the model's dtype
        (:meth:`keeps_fp32`); trainable parameters kept in fp32 through training."""
        flag = "is_loaded_in_4bit" if self.bits == 4 else "is_loaded_in_8bit"
        if not getattr(model, flag, False):
            raise FtcoreError(f"quantizer '{self.name}': the model loader ignored the quantizer (the model is not "
                              f"loaded in {self.bits}-bit); use a loader that passes load_kwargs() to "
                              "from_pretrained, such as [model] use = \"hf\"")
        quantized_nothing(model, self.name, self.bits)
        from ftcore_plugins.common.device_defaults import training_device

        if self.keeps_fp32(training_device()):
            from peft import prepare_model_for_kbit_training

            # Freezes every base weight, upcasts fp16/bf16 non-quantized weights (norms, embeddings,
            # lm_head) to fp32 and turns on non-reentrant gradient checkpointing (no input-grad hook
            # needed with use_reentrant=False).
            model = prepare_model_for_kbit_training(
                model, use_gradient_checkpointing=self.options.gradient_checkpointing,
                gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            # The same without the upcast, as TRL's SFTTrainer leaves them: fp32 copies of a 128k-vocabulary
            # 8B model's embeddings and head are 4.2 GB, and fp32 norms make the residual stream fp32 too.
            for p in model.parameters():
                p.requires_grad_(False)
            if self.options.gradient_checkpointing:
                # Non-reentrant, as above: gradients reach the adapters inside a block whose input needs
                # none (peft adds its input-grad hook for reentrant checkpointing only).
                enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.x's name
                if enable is not None:
                    enable(activation_checkpointing_kwargs={"use_reentrant": False})
                else:  # pragma: no cover - older transformers
                    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # A KV cache is useless in training and conflicts with checkpointing. generate() still
        # uses one: it follows generation_config.use_cache, not config.use_cache.
        model.config.use_cache = False
        keep_trainable_fp32(model)
        keep_cpu_layout_trainable(model)
        line = unquantized_experts(model, self.name)
        if line:
            log.info(line)
        return model

    def keeps_fp32(self, device: str) -> bool:
        """Whether prepare() upcasts the non-quantized weights on ``device`` ("cpu", "cuda"): the
        ``fp32_non_quantized`` option, else the device's default (``common/device_defaults.py``)."""
        from ftcore_plugins.common.device_defaults import defaults

        own = self.options.fp32_non_quantized
        return defaults(device).fp32_non_quantized if own is None else own

    # -- ftcore estimate (optional; see plugins/_estimate.py) ---------------------------------
    def prepare_meta(self, model, *, device: str = "cpu"):
        from ftcore_plugins.common.estimate import bnb_prepare_meta

        return bnb_prepare_meta(self, model, device=device)

    def weight_bytes(self, model) -> int:
        from ftcore_plugins.common.estimate import bnb_weight_bytes

        return bnb_weight_bytes(self, model)

    def step_bytes(self, model, *, device: str = "cpu") -> int:
        from ftcore_plugins.common.estimate import bnb_step_bytes

        return bnb_step_bytes(self, model, device=device)

    def weight_notes(self, model) -> list[str]:
        line = unquantized_experts(model, self.name, counted=True)
        return [line] if line else []


def unquantized_experts(model: Any, quantizer: str, *, counted: bool = False) -> str | None:
    """One line on a mixture-of-experts model's routed experts stored as 3-D parameters, which stay at full
    precision: transformers' bitsandbytes integration replaces linear layers only (bitsandbytes' own
    ``replace_parameter_4bit`` quantizes such parameters, but neither transformers' loading nor peft's LoRA on
    parameters, ``ParamWrapper``, works with it: docs/methods.md). ``counted``: worded for ``ftcore estimate``."""
    from ftcore_plugins.common.experts import expert_parameters

    experts = expert_parameters(model)
    if not experts:
        return None
    n = sum(p.numel() for p in experts.values())
    size = sum(p.numel() * p.element_size() for p in experts.values())
    dtypes = ", ".join(sorted({str(p.dtype).replace("torch.", "") for p in experts.values()}))
    return (f"quantizer '{quantizer}': the routed experts ({n:,} parameters in {len(experts)} tensors, "
            f"{size / 2**30:.2f} GiB) stay in {dtypes}" + (", and are counted so" if counted else "")
            + ": transformers' bitsandbytes integration quantizes linear layers only")


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


def keep_cpu_layout_trainable(model) -> None:
    """Stop bitsandbytes repacking 4-bit weights into its CPU inference layout.

    On a CPU with AVX512-BF16, a ``Linear4bit`` that runs a forward in eval mode without
    gradients (an evaluation before training, or an ``eval_data`` pass between epochs)
    rewrites its weight into a layout that only the ``gemv_4bit`` kernel reads, and that
    kernel has no backward: later training forwards then pass no gradient back through the
    base layers, so every adapter below the last layer silently stops learning (bitsandbytes
    0.50 only warns that "an autograd kernel was not registered"). A model prepared for
    training keeps the standard layout; evaluation on the CPU is then somewhat slower.
    """
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def quantized_nothing(model: Any, quantizer: str, bits: int) -> None:
    """Refuse a model in which bitsandbytes replaced no layer: transformers still marks it loaded in 4 or 8
    bits, but a family whose linear layers are its own classes (Falcon's ``FalconLinear``) keeps every weight
    at full precision, and the stage would train a plain LoRA under the quantizer's name."""
    import bitsandbytes as bnb
    import torch

    kinds = (bnb.nn.Linear4bit,) if bits == 4 else (bnb.nn.Linear8bitLt,)
    if any(isinstance(m, kinds) for m in model.modules()):
        return
    model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    linear = sorted({type(m).__name__ for m in model.modules() if isinstance(m, torch.nn.Linear)})
    raise FtcoreError(f"quantizer '{quantizer}': bitsandbytes quantized no layer of this {model_type} model (its "
                      f"linear layers are {', '.join(linear) or 'none'}, which transformers' bitsandbytes "
                      "integration does not replace); use [quantizer] use = \"none\" to train at full precision")


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


def four_bit_config(quant_type: str, o: Any):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                              bnb_4bit_use_double_quant=o.bnb_4bit_use_double_quant,
                              bnb_4bit_compute_dtype=compute_dtype(o.bnb_4bit_compute_dtype),
                              bnb_4bit_quant_storage=o.bnb_4bit_quant_storage)


class FourBitOptions(BnbOptions):
    bnb_4bit_use_double_quant: bool = True  # quantize the quantization constants too (~0.4 bit/weight saved)
    bnb_4bit_compute_dtype: Literal[DTYPES] = "auto"  # type: ignore[valid-type]
    bnb_4bit_quant_storage: Literal["uint8", "bfloat16", "float16", "float32"] = "uint8"  # FSDP: the model's dtype


class FourBitQuantizer(BnbQuantizer):
    """4-bit bitsandbytes quantization; subclasses set ``quant_type``."""

    bits = 4
    quant_type: ClassVar[str] = "nf4"
    Options = FourBitOptions

    def bnb_config(self):
        return four_bit_config(self.quant_type, self.options)
