"""Adapter ``ia3``: (IA)^3, learned scaling vectors on chosen layers (peft)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

import ftcore
from ftcore.component import Options

from ftcore_plugins.adapters.lora import PeftAdapter, TargetModules


class Ia3Adapter(PeftAdapter):
    """(IA)^3 (peft): trains one scaling vector per targeted layer: the output of attention layers,
    the input of feedforward layers. Far fewer parameters than LoRA."""

    name = "ia3"

    class Options(Options):
        target_modules: TargetModules = "all-linear"
        feedforward_modules: Annotated[list[str], Field(min_length=1)] | Literal["auto"] = "auto"  # auto: the MLP output projections
        modules_to_save: list[str] | None = None

    def peft_config(self, model, ctx):
        from peft import IA3Config

        from ftcore_plugins.adapters._targets import check_modules_to_save, resolve

        o = self.options
        targets = resolve(model, o.target_modules, embeddings=False, feedforward=o.feedforward_modules)
        check_modules_to_save(model, o.modules_to_save)
        ctx.reporter.info(f"adapter {self.name}: targets {targets.describe()}; feedforward (input scaled): "
                          f"{', '.join(targets.feedforward) or 'none'}")
        return IA3Config(task_type="CAUSAL_LM", target_modules=targets.names,
                         feedforward_modules=targets.feedforward, fan_in_fan_out=targets.conv1d,
                         modules_to_save=o.modules_to_save)


@ftcore.hookimpl
def register_adapters(register):
    register(Ia3Adapter)
