"""Adapter ``prompt_tuning``: trained virtual tokens prepended to every input (peft).

Also :class:`PromptLearningAdapter`, which ``prefix_tuning`` shares: adapters that are not
weights, so they cannot be merged.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

import ftcore
from ftcore.component import Options
from ftcore.errors import FtcoreError

from ftcore_plugins.adapters.lora import PeftAdapter
from ftcore_plugins.common.model import resolve_model_path
from ftcore_plugins.common.seq2seq import plan_encoder_decoder, refusal

MERGING_EXPORTERS = ("merged", "onnx", "gguf")


def _same(a: Any, b: Any) -> bool:
    return a.reg is b.reg and a.options == b.options


class PromptLearningAdapter(PeftAdapter):
    """Base of prompt and prefix tuning: trained vectors the model reads besides its input, never a
    change to its weights. So it cannot be merged: a stage with another adapter cannot follow it,
    and the ``merged`` exporter cannot write it (check() says so before anything runs)."""

    mergeable: ClassVar[bool] = False

    def check(self, plan):
        problems = super().check(plan)
        # Which stage this is: Selected.create() hands the stage's own options object to the instance.
        index = next((i for i, s in enumerate(plan.stages) if s.adapter.options is self.options), None)
        if index is None:
            return problems
        if family := plan_encoder_decoder(plan):  # the sft path trains these on causal LMs only (with_loss)
            problems.append(refusal(f"adapter '{self.name}'", family, "ftcore places its virtual tokens in a causal "
                                    "LM's input", "use adapter \"lora\" or \"full\""))
        stage = plan.stages[index]
        why = (f"{self.name} trains virtual tokens, not weights, so it cannot be merged into the model")
        if index + 1 < len(plan.stages) and not _same(plan.stages[index + 1].adapter, stage.adapter):
            nxt = plan.stages[index + 1]
            problems.append(f"stage '{nxt.name}' uses adapter '{nxt.adapter.name}' after this stage, which would "
                            f"merge it into the weights; {why}: make the {self.name} stage the last one (later "
                            "stages may only continue the same adapter)")
        if index == len(plan.stages) - 1:
            for export in plan.exports:
                if export.exporter.name in MERGING_EXPORTERS:
                    problems.append(f"[[export]] '{export.name}' (use = \"{export.exporter.name}\") folds the adapter "
                                    f"into the weights; {why}: export it with use = \"adapter\" instead")
        if getattr(stage.trainer.options, "packing", False):
            problems.append(f"stage '{stage.name}' packs samples (packing = true), but {self.name} prepends its "
                            "virtual tokens once per packed sequence, not once per sample; set packing = false")
        return problems

    def fresh(self, config: Any) -> Any:
        """The saved config as the restored model is built from it, before the saved weights load."""
        return config

    def restore(self, base, path, ctx):
        # PeftModel.from_pretrained refuses is_trainable=True for prompt learning; build the model
        # trainable from the saved config, then load the saved vectors into it.
        from peft import PeftConfig, get_peft_model, set_peft_model_state_dict
        from peft.utils import load_peft_weights

        config = PeftConfig.from_pretrained(str(path))
        config.inference_mode = False
        model = get_peft_model(base, self.fresh(config))
        # The vectors load into the prompt encoder (peft reports them as unexpected for the model itself).
        set_peft_model_state_dict(model, load_peft_weights(str(path)))
        return model

    def merge(self, model):
        raise FtcoreError(f"adapter {self.name} trains virtual tokens, not weights: it cannot be merged into the "
                          "model (export it with use = \"adapter\")")


class PromptTuningAdapter(PromptLearningAdapter):
    """Prompt tuning (peft): num_virtual_tokens trained embeddings prepended to every input; the
    model itself is frozen."""

    name = "prompt_tuning"

    class Options(Options):
        num_virtual_tokens: int = Field(20, gt=0)
        prompt_tuning_init: Literal["RANDOM", "TEXT", "SAMPLE_VOCAB"] = "RANDOM"
        prompt_tuning_init_text: str | None = None  # for TEXT: the text whose token embeddings start the prompt
        tokenizer_name_or_path: str | None = None  # for TEXT: defaults to the model loader's tokenizer/path

        _paths = field_validator("tokenizer_name_or_path")(resolve_model_path)

        @model_validator(mode="after")
        def _text(self):
            if (self.prompt_tuning_init == "TEXT") != (self.prompt_tuning_init_text is not None):
                raise ValueError("prompt_tuning_init = \"TEXT\" and prompt_tuning_init_text go together: "
                                 "TEXT starts the prompt from that text's token embeddings")
            return self

    def check(self, plan):
        problems = super().check(plan)
        if self.options.prompt_tuning_init == "TEXT" and not self._tokenizer(plan):
            problems.append(f"prompt_tuning_init = \"TEXT\" needs a tokenizer and model loader '{plan.model.name}' "
                            "names none: set tokenizer_name_or_path (a tokenizer folder or hub id)")
        return problems

    def _tokenizer(self, plan) -> str | None:
        """The tokenizer for TEXT init: the option, else the model loader's ``tokenizer`` or ``path``."""
        loader = plan.model.options if plan is not None else None
        found = self.options.tokenizer_name_or_path or getattr(loader, "tokenizer", None) \
            or getattr(loader, "path", None)
        return str(found) if found else None

    def label(self) -> str:
        return f"adapter {self.name} ({self.options.num_virtual_tokens} virtual tokens)"

    def peft_config(self, model, ctx):
        from peft import PromptTuningConfig

        o = self.options
        text = {}
        if o.prompt_tuning_init == "TEXT":
            tokenizer = self._tokenizer(ctx.run.plan if ctx.run is not None else None)
            if tokenizer is None:
                raise FtcoreError("adapter prompt_tuning: prompt_tuning_init = \"TEXT\" needs "
                                  "tokenizer_name_or_path (a tokenizer folder or hub id)")
            text = {"prompt_tuning_init_text": o.prompt_tuning_init_text, "tokenizer_name_or_path": tokenizer}
        return PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=o.num_virtual_tokens,
                                  prompt_tuning_init=o.prompt_tuning_init, **text)

    def fresh(self, config):
        config.prompt_tuning_init = "RANDOM"  # the saved vectors replace it: no tokenizer to load
        return config


@ftcore.hookimpl
def register_adapters(register):
    register(PromptTuningAdapter)
