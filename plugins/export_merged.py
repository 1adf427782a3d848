"""Exporter ``merged``: a standalone safetensors model folder with its tokenizer, adapter folded in."""

from __future__ import annotations

import copy
from typing import Literal

import ftcore
from ftcore.component import Component, Options


class MergedExporter(Component):
    """A plain transformers model folder (safetensors + tokenizer), adapters merged in."""

    name = "merged"

    class Options(Options):
        dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: as trained

    def export(self, ctx):
        import torch

        model = ctx.model
        if ctx.adapter is not None and getattr(ctx.adapter, "peft", False):
            # Merge a copy: the live model keeps its adapter for any later export.
            model = ctx.adapter.merge(copy.deepcopy(model))
        if self.options.dtype != "auto":
            model = model.to(getattr(torch, self.options.dtype)) if model is not ctx.model \
                else copy.deepcopy(model).to(getattr(torch, self.options.dtype))
        ctx.path.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(ctx.path)
        ctx.tokenizer.save_pretrained(ctx.path)
        return ctx.path


@ftcore.hookimpl
def register_exporters(register):
    register(MergedExporter)
