"""Adapter ``prefix_tuning``: trained key/value prefixes at every attention layer (peft)."""

from __future__ import annotations

from pydantic import Field

import ftcore
from ftcore.component import Options

from ftcore_plugins.adapters.prompt_tuning import PromptLearningAdapter


class PrefixTuningAdapter(PromptLearningAdapter):
    """Prefix tuning (peft): num_virtual_tokens trained keys and values prepended at every attention
    layer; the model itself is frozen."""

    name = "prefix_tuning"

    class Options(Options):
        num_virtual_tokens: int = Field(20, gt=0)
        prefix_projection: bool = False  # train the prefixes through a two-layer MLP (reparametrisation)
        encoder_hidden_size: int | None = Field(None, gt=0)  # that MLP's width; default: the model's hidden size

    def label(self) -> str:
        return f"adapter {self.name} ({self.options.num_virtual_tokens} virtual tokens)"

    def peft_config(self, model, ctx):
        from peft import PrefixTuningConfig

        o = self.options
        width = o.encoder_hidden_size or model.config.hidden_size
        return PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=o.num_virtual_tokens,
                                  prefix_projection=o.prefix_projection, encoder_hidden_size=width)

    def fresh(self, config):
        # peft saves a projected prefix as the final keys and values, without the MLP that made them:
        # the restored adapter trains those directly (same outputs, no reparametrisation any more).
        config.prefix_projection = False
        return config


@ftcore.hookimpl
def register_adapters(register):
    register(PrefixTuningAdapter)
