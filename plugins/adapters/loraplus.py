"""Adapter ``loraplus``: LoRA trained with peft's LoRA+ optimizer (a higher learning rate for B)."""

from __future__ import annotations

from pydantic import Field

import ftcore
from ftcore.errors import FtcoreError

from ftcore_plugins.adapters.lora import LoraAdapter, LoraOptions


class LoraPlusOptimizer:
    """Builds ``peft.optimizers.create_loraplus_optimizer`` for a model, from the trainer's arguments.

    The optimizer class and its settings (betas, eps, ...) are the ones the stage's ``optimizer``
    option names, as transformers resolves them; the lora_B matrices get ``learning_rate x
    loraplus_lr_ratio``, LoRA embedding layers ``loraplus_lr_embedding``. The trainer's scheduler
    then scales every group alike.
    """

    def __init__(self, lr_ratio: float, lr_embedding: float):
        self.lr_ratio, self.lr_embedding = lr_ratio, lr_embedding

    def __call__(self, model, args):
        import torch
        from peft.optimizers import create_loraplus_optimizer
        from transformers import Trainer

        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) \
                or {"params", "model", "optimizer_dict"} & set(kwargs):
            raise FtcoreError(f"adapter 'loraplus' needs an optimizer that takes parameter groups; "
                              f"optimizer {args.optim!r} does not: use \"adamw_torch\" (the default)")
        return create_loraplus_optimizer(model, cls, loraplus_lr_ratio=self.lr_ratio,
                                         loraplus_lr_embedding=self.lr_embedding,
                                         loraplus_weight_decay=args.weight_decay, **kwargs)


class LoraPlusAdapter(LoraAdapter):
    """LoRA+ (peft): LoRA whose B matrices learn loraplus_lr_ratio times faster than the A matrices."""

    name = "loraplus"

    class Options(LoraOptions):
        loraplus_lr_ratio: float = Field(16.0, gt=0)
        loraplus_lr_embedding: float = Field(1e-6, ge=0)

    def optimizer(self, model, args):
        """The trainer builds its optimizer with this (``ctx.adapter.optimizer``) instead of its own."""
        return LoraPlusOptimizer(self.options.loraplus_lr_ratio, self.options.loraplus_lr_embedding)(model, args)


@ftcore.hookimpl
def register_adapters(register):
    register(LoraPlusAdapter)
