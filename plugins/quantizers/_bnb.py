"""What the bitsandbytes quantizers (``bnb-nf4``, ``bnb-fp4``, ``bnb-int8``) share: the
bitsandbytes side of the QLoRA preparation of the loaded model (the plan checks and ``load_kwargs()``
are every quantizer's: ``_base.py``).

The weights are quantized as transformers loads them (``quantization_config``), so only a
model loader that passes ``load_kwargs()`` to ``from_pretrained`` can use these quantizers:
``hf`` does; ``scratch`` builds a random model from a config and is refused (see
:meth:`WeightQuantizer.check`). ``prepare()`` checks that the weights really came out quantized,
so a third-party loader that drops ``load_kwargs()`` fails at once, not after training.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from ftcore.errors import FtcoreError
from ftcore_plugins.quantizers._base import QuantizerOptions, WeightQuantizer, compute_dtype

DTYPES = ("auto", "float32", "bfloat16", "float16")


class BnbOptions(QuantizerOptions):
    """Options every bitsandbytes quantizer takes (transformers' ``BitsAndBytesConfig`` names)."""

    fp32_non_quantized: bool | None = None  # norms, embeddings, LM head in fp32; unset: the device's (CPU yes, CUDA no)


class BnbQuantizer(WeightQuantizer):
    """Base of the bitsandbytes quantizers; subclasses set ``name``, ``bits`` and ``Options``."""

    bits: ClassVar[int] = 4
    Options = BnbOptions
    linear_only = "transformers' bitsandbytes integration quantizes linear layers only"

    # -- loading ---------------------------------------------------------------------------
    def bnb_config(self):  # pragma: no cover - overridden
        raise NotImplementedError

    def quantization_config(self):
        return self.bnb_config()

    def quantized_modules(self, model) -> list[str]:
        import bitsandbytes as bnb

        kinds = (bnb.nn.Linear4bit,) if self.bits == 4 else (bnb.nn.Linear8bitLt,)
        return [path for path, m in model.named_modules() if isinstance(m, kinds)]

    def verify(self, model) -> None:
        flag = "is_loaded_in_4bit" if self.bits == 4 else "is_loaded_in_8bit"
        if not getattr(model, flag, False):
            raise FtcoreError(f"quantizer '{self.name}': the model loader ignored the quantizer (the model is not "
                              f"loaded in {self.bits}-bit); use a loader that passes load_kwargs() to "
                              "from_pretrained, such as [model] use = \"hf\"")
        quantized_nothing(model, self.name, self.bits)

    def freeze(self, model) -> None:
        """QLoRA preparation: the base frozen with the non-quantized weights in fp32 or left in the model's dtype
        (:meth:`keeps_fp32`), non-reentrant checkpointing, bitsandbytes' trainable CPU layout kept."""
        from ftcore_plugins.common.device_defaults import training_device

        if self.keeps_fp32(training_device()):
            from peft import prepare_model_for_kbit_training

            # Freezes every base weight, upcasts fp16/bf16 non-quantized weights (norms, embeddings,
            # lm_head) to fp32 and turns on non-reentrant gradient checkpointing (no input-grad hook
            # needed with use_reentrant=False).
            prepare_model_for_kbit_training(
                model, use_gradient_checkpointing=self.options.gradient_checkpointing,
                gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            # The same without the upcast, as TRL's SFTTrainer leaves them: fp32 copies of a 128k-vocabulary
            # 8B model's embeddings and head are 4.2 GB, and fp32 norms make the residual stream fp32 too.
            super().freeze(model)
        keep_cpu_layout_trainable(model)

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

    def step_bytes(self, model, *, device: str = "cpu", tokens: int = 0) -> int:
        from ftcore_plugins.common.estimate import bnb_step_bytes

        return bnb_step_bytes(self, model, device=device, tokens=tokens)


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
