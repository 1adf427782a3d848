"""Adapter ``full``: no adapter; every parameter trains."""

from __future__ import annotations

import ftcore
from ftcore.component import Component

from ftcore_plugins.common.model import report_trainable
from ftcore_plugins.common.tokens import ADDED_IDS, TEMPLATE_IDS, added_token_ids, template_token_ids


class FullAdapter(Component):
    """Full fine-tuning: every parameter is trainable, no adapter."""

    name = "full"
    peft = False

    def apply(self, model, ctx):
        for p in model.parameters():
            p.requires_grad_(True)
        report_trainable(model, ctx.reporter, "full fine-tuning")
        return model

    def save(self, model, path):
        model.save_pretrained(path)  # safetensors

    def restore(self, base, path, ctx):
        model = type(base).from_pretrained(path, dtype=base.dtype)
        model.generation_config = base.generation_config
        # The template's added tokens are the base's record, not the saved model's: without it a LoRA
        # stage after this one (a resumed run restores this stage) would leave their rows frozen.
        for name, ids in ((ADDED_IDS, added_token_ids(base)), (TEMPLATE_IDS, template_token_ids(base))):
            if ids:
                setattr(model, name, ids)
        return model

    def merge(self, model):
        return model


@ftcore.hookimpl
def register_adapters(register):
    register(FullAdapter)
