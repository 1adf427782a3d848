"""Exporter ``adapter``: the trained adapter as a peft folder (``PeftModel.from_pretrained`` loads it)."""

from __future__ import annotations

from pathlib import Path

import ftcore
from ftcore import rundir
from ftcore.component import Component
from ftcore.errors import FtcoreError

from ftcore_plugins.common.seq2seq import auto_class
from ftcore_plugins.common.vision import processor_of
from ftcore_plugins.exporters._card import card_path, write_card
from ftcore_plugins.exporters._vision import ADAPTER_USAGE

USAGE = """
from peft import PeftModel
from transformers import {auto}, AutoTokenizer

base = {auto}.from_pretrained("{base}")  # the model the adapter was trained on
model = PeftModel.from_pretrained(base, "{path}")
tokenizer = AutoTokenizer.from_pretrained("{path}")
"""


def last_adapter_is_peft(plan) -> bool:
    return bool(plan.stages) and bool(getattr(plan.stages[-1].adapter.reg.cls, "peft", False))


class AdapterExporter(Component):
    """The trained adapter as a peft folder, with the tokenizer and a model card beside it."""

    name = "adapter"

    def check(self, plan):
        if not last_adapter_is_peft(plan):
            used = plan.stages[-1].adapter.name if plan.stages else "no stage"
            return [f"exporter 'adapter' needs the last stage to train a peft adapter (it uses {used!r}); "
                    "use [[export]] use = \"merged\" instead"]
        return []

    def export(self, ctx):
        if ctx.adapter is None or not getattr(ctx.adapter, "peft", False):
            raise FtcoreError("exporter 'adapter': the model has no peft adapter to export")
        config = ctx.model.peft_config[ctx.model.active_adapter]
        # The exact base (an earlier stage's output, the plan's model, a scratch model saved for this),
        # recorded where peft looks (adapter_config.json) and in the card's snippet.
        base = adapter_base(ctx)
        if base is not None:
            config.base_model_name_or_path = base
        ctx.path.mkdir(parents=True, exist_ok=True)
        ctx.model.save_pretrained(ctx.path)
        ctx.tokenizer.save_pretrained(ctx.path)
        processor = processor_of(ctx.tokenizer)
        if processor is not None:  # a vision-language model: its processor too (image processor, template)
            processor.save_pretrained(ctx.path)
        base = card_path(ctx, base) if base is not None and Path(base).exists() else \
            (base or config.base_model_name_or_path or "path/to/base-model")
        write_card(ctx.path, ctx, title=f"{config.peft_type.value.lower()} adapter", library="peft",
                   tags=["peft", ctx.adapter.name],
                   usage=(ADAPTER_USAGE if processor is not None else USAGE).format(
                       base=base, path=card_path(ctx), auto=auto_class(ctx.model.config).__name__))
        return ctx.path


def adapter_base(ctx) -> str | None:
    """Where the model the live adapter was applied to loads from on its own: the output of the last stage
    before the adapter's first one that trained the policy, when that is a whole model (with its
    tokenizer); else the plan's base model as it was loaded (a hub id or a folder); a model made from
    scratch is saved once to ``model/base`` in the run folder for this. None when no folder holds it (the
    adapter sits on top of an earlier stage's adapter)."""
    plan, run_dir = ctx.run.plan, ctx.run.run_dir
    before = ctx.adapter_from - 1
    while before >= 0 and not plan.stages[before].trains_policy:
        before -= 1
    if before >= 0:
        output = run_dir / "stages" / plan.stages[before].name / "output"
        return str(output) if (output / "config.json").is_file() else None
    path = getattr(plan.model.options, "path", None)
    if isinstance(path, (str, Path)):
        return str(path)
    saved = run_dir / "model" / "base"
    if not (saved / "config.json").is_file() and ctx.run.is_main and ctx.load_model is not None:
        model, tokenizer = ctx.load_model("base")
        partial = saved.with_name(".base.partial")
        rundir.remove(partial)
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        rundir.replace_atomically(partial, saved)
    return str(saved) if (saved / "config.json").is_file() else None


@ftcore.hookimpl
def register_exporters(register):
    register(AdapterExporter)
