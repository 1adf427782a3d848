"""Adapter ``ia3``: (IA)^3, learned scaling vectors on chosen layers (peft)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

import ftcore
from ftcore.component import Options

from ftcore_plugins.adapters.lora import PeftAdapter, TargetModules
from ftcore_plugins.common.seq2seq import peft_task_type


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

        from ftcore_plugins.adapters._targets import check_modules_to_save, expert_parameters, parameter_names, resolve

        o = self.options
        # peft's IA3 scales modules' inputs or outputs: a mixture-of-experts model's experts stored as parameters
        # (transformers 5's fused experts) are out of its reach, and stay frozen.
        targets = resolve(model, o.target_modules, embeddings=False, feedforward=o.feedforward_modules,
                          parameters=False)
        check_modules_to_save(model, o.modules_to_save)
        ctx.reporter.info(f"adapter {self.name}: targets {targets.describe()}; feedforward (input scaled): "
                          f"{', '.join(targets.feedforward) or 'none'}")
        experts = list(expert_parameters(model))
        if experts and isinstance(o.target_modules, str) and o.target_modules != "attention":
            ctx.reporter.warn(f"adapter {self.name}: this model's experts are parameters "
                              f"({', '.join(parameter_names(experts, model))}), which IA3 cannot scale: they stay "
                              "frozen; adapter \"lora\" adapts them")
        return IA3Config(task_type=peft_task_type(model), target_modules=targets.names,
                         feedforward_modules=targets.feedforward, fan_in_fan_out=targets.conv1d,
                         modules_to_save=o.modules_to_save)


@ftcore.hookimpl
def register_adapters(register):
    register(Ia3Adapter)
