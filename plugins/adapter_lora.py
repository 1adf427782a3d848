"""Adapter ``lora``: low-rank adapters through peft."""

from __future__ import annotations

from typing import Literal

import ftcore
from ftcore.component import Component, Options


def report_trainable(model, reporter, label: str) -> dict:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    share = 100.0 * trainable / total if total else 0.0
    reporter.info(f"{label}: {trainable:,} trainable parameters of {total:,} ({share:.2f}%)")
    return {"trainable_params": trainable, "total_params": total, "trainable_percent": share}


class LoraAdapter(Component):
    """LoRA (peft): trains low-rank updates to the chosen linear layers."""

    name = "lora"
    peft = True  # produces a peft adapter folder

    class Options(Options):
        r: int = 8
        lora_alpha: int = 16
        lora_dropout: float = 0.0
        target_modules: list[str] | Literal["all-linear"] = "all-linear"
        bias: Literal["none", "all", "lora_only"] = "none"
        use_rslora: bool = False
        modules_to_save: list[str] | None = None

    def config(self):
        from peft import LoraConfig

        o = self.options
        return LoraConfig(task_type="CAUSAL_LM", r=o.r, lora_alpha=o.lora_alpha, lora_dropout=o.lora_dropout,
                          target_modules=o.target_modules, bias=o.bias, use_rslora=o.use_rslora,
                          modules_to_save=o.modules_to_save)

    def apply(self, model, ctx):
        from peft import get_peft_model

        model = get_peft_model(model, self.config())
        report_trainable(model, ctx.reporter, f"adapter {self.name} (r={self.options.r})")
        return model

    def save(self, model, path):
        model.save_pretrained(path)  # adapter weights only, as safetensors

    def restore(self, base, path, ctx):
        from peft import PeftModel

        return PeftModel.from_pretrained(base, path, is_trainable=True)

    def merge(self, model):
        return model.merge_and_unload()


@ftcore.hookimpl
def register_adapters(register):
    register(LoraAdapter)
