"""Adapter ``freeze``: no adapter; only the last layers (and/or parameters matching patterns) train."""

from __future__ import annotations

import re

from pydantic import Field, field_validator, model_validator

import ftcore
from ftcore.component import Options
from ftcore.errors import FtcoreError

from ftcore_plugins.adapters.full import FullAdapter
from ftcore_plugins.common.model import report_trainable


def decoder_layers(model) -> tuple[str, int]:
    """The model's stack of transformer blocks: (its module path, its length). The ModuleList of
    same-typed blocks holding the most parameters: ``model.layers``, ``transformer.h``, ..."""
    import torch

    best = None
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) and len({type(m) for m in module}) == 1:
            size = sum(p.numel() for p in module.parameters())
            if best is None or size > best[2]:
                best = (path, len(module), size)
    if best is None:
        raise FtcoreError(f"adapter freeze: found no stack of transformer layers in this "
                          f"{type(model).__name__}; use trainable_layers = 0 and trainable_patterns")
    return best[0], best[1]


class FreezeAdapter(FullAdapter):
    """Freeze tuning: every weight is frozen except the last trainable_layers transformer blocks and
    the parameters whose names match trainable_patterns. Saved, restored and exported like full."""

    name = "freeze"

    class Options(Options):
        trainable_layers: int = Field(2, ge=0)  # the last N transformer blocks train
        trainable_patterns: list[str] = []  # regular expressions searched in parameter names: these train too

        @field_validator("trainable_patterns")
        @classmethod
        def _compile(cls, patterns):
            for p in patterns:
                try:
                    re.compile(p)
                except re.error as exc:
                    raise ValueError(f"{p!r} is not a regular expression: {exc}") from None
            return patterns

        @model_validator(mode="after")
        def _something(self):
            if self.trainable_layers == 0 and not self.trainable_patterns:
                raise ValueError("nothing would train: set trainable_layers > 0 or trainable_patterns")
            return self

    def freeze(self, model) -> list[str]:
        """Set requires_grad; return the trainable parameter names."""
        o = self.options
        prefixes: tuple[str, ...] = ()
        if o.trainable_layers:
            path, count = decoder_layers(model)
            if o.trainable_layers > count:
                raise FtcoreError(f"adapter freeze: trainable_layers = {o.trainable_layers}, but this model has "
                                  f"{count} layers ({path})")
            prefixes = tuple(f"{path}.{i}." for i in range(count - o.trainable_layers, count))
        # Tied weights are listed under every name, so "lm_head" finds a head tied to the embeddings.
        named = list(model.named_parameters(remove_duplicate=False))
        patterns = [re.compile(p) for p in o.trainable_patterns]
        for pattern in patterns:
            if not any(pattern.search(name) for name, _ in named):
                shapes = dict.fromkeys(re.sub(r"\.\d+\.", ".*.", name) for name, _ in named)
                raise FtcoreError(f"adapter freeze: trainable_patterns {pattern.pattern!r} matches no parameter; "
                                  f"the parameters are: {', '.join(shapes)}")
        for _, p in named:
            p.requires_grad_(False)
        chosen = [name for name, p in named if name.startswith(prefixes) or any(r.search(name) for r in patterns)]
        for name, p in named:
            if name in set(chosen):
                p.requires_grad_(True)
        return chosen

    def apply(self, model, ctx):
        self.freeze(model)
        o = self.options
        what = ([f"last {o.trainable_layers} layers"] if o.trainable_layers else []) + \
            [f"/{p}/" for p in o.trainable_patterns]
        report_trainable(model, ctx.reporter, f"adapter freeze ({' + '.join(what)})")
        return model

    def restore(self, base, path, ctx):
        model = super().restore(base, path, ctx)
        self.freeze(model)  # a later stage may continue training it
        return model


@ftcore.hookimpl
def register_adapters(register):
    register(FreezeAdapter)
