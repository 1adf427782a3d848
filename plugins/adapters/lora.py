"""Adapter ``lora``: low-rank adapters through peft.

Also what the other peft adapters share: :class:`PeftAdapter` (apply, save, restore, merge
through peft, and the trainable-parameter report) and :class:`LoraAdapter`, which the LoRA
variants (``dora``, ``rslora``, ``pissa``, ``olora``, ``loftq``, ``loraplus``) subclass.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

import ftcore
from ftcore.component import Component, Options
from ftcore.errors import FtcoreError

from ftcore_plugins.common.expert_lora import disable as disable_grouped_experts
from ftcore_plugins.common.expert_lora import enable as enable_grouped_experts
from ftcore_plugins.common.model import report_trainable
from ftcore_plugins.common.seq2seq import peft_task_type
from ftcore_plugins.common.tokens import expose_head_bias, train_added_tokens

Preset = Literal["all-linear", "attention", "mlp"]
TargetModules = Annotated[list[str], Field(min_length=1)] | Preset  # a preset, or module names (see _targets)


class PeftAdapter(Component):
    """Base of the adapters peft implements: subclasses set ``name`` and ``Options`` and build the
    peft config in :meth:`peft_config`.

    ``save`` writes the adapter folder (``save_pretrained``: adapter weights as safetensors and
    ``adapter_config.json``); ``restore`` loads it onto the base with ``PeftModel.from_pretrained``,
    trainable; ``merge`` folds it into the weights with ``merge_and_unload``. A LoRA on fused expert parameters
    runs per expert through transformers' grouped matmul once peft has wrapped the model (``common/expert_lora.py``).
    """

    peft: ClassVar[bool] = True  # produces a peft adapter folder (the `adapter` exporter checks this)
    mergeable: ClassVar[bool] = True  # merge_and_unload can fold it into the weights
    full_precision_base: ClassVar[bool] = False  # its initialisation rewrites full-precision base weights

    def peft_config(self, model: Any, ctx: Any) -> Any:
        raise NotImplementedError

    def label(self) -> str:
        return f"adapter {self.name}"

    def init_seed(self, plan_seed: int) -> int:
        """The seed of the adapter's random initialisation: derived from the plan's seed and this
        adapter's name and options, never the plan's seed itself. The ``scratch`` loader initialises
        the weights from the plan's seed, and LoRA's A matrices drawn from that same stream come out
        correlated with them (about -0.36 with the embeddings), which measurably slowed training."""
        # Options added later are left out while off, so that adding them changed no run's initialisation
        # (the quickstart's exact match went from 1.00 to 0.44 when vision_tower and train_projector came
        # in); train_template_tokens always, as it changes which embedding rows train, not LoRA's matrices.
        later = ("vision_tower", "train_projector", "target_parameters")
        unset = {"train_template_tokens", *(k for k in later if not getattr(self.options, k, False))}
        key = f"{plan_seed}:adapter:{self.name}:{self.options.model_dump_json(exclude=unset)}".encode()
        return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") % 2**63

    def check(self, plan) -> list[str]:
        if self.full_precision_base and plan.quantizer.name != "none":
            return [f"adapter '{self.name}' initialises from the full-precision weights and rewrites them, which "
                    f"peft cannot do on quantizer '{plan.quantizer.name}' weights; use [quantizer] use = \"none\", "
                    "or adapter \"lora\" on quantized weights"]
        return []

    def apply(self, model, ctx):
        import torch
        from peft import get_peft_model

        # A template's added tokens (an end-of-turn marker) get their embedding rows trained too.
        config = train_added_tokens(self.peft_config(model, ctx), model, self.name,
                                    template_tokens=getattr(self.options, "train_template_tokens", False))
        # The adapter's random initialisation is seeded by the plan, whatever ran before it: a resumed
        # run, which restores earlier stages instead of training them, starts this one the same.
        with torch.random.fork_rng():
            if ctx.run is not None:
                torch.manual_seed(self.init_seed(ctx.run.plan.seed))
            model = expose_head_bias(get_peft_model(model, config))
        enable_grouped_experts(model)
        self.report_targets(model, ctx)
        counts = report_trainable(model, ctx.reporter, self.label())
        own = counts["total_params"] - counts["trainable_params"]
        if counts["trainable_params"] > own:
            ctx.reporter.warn(f"{self.label()} trains {counts['trainable_params']:,} parameters, more than the "
                              f"model's own {own:,}: an adapter that large saves nothing over full fine-tuning; "
                              "choose a smaller one, or adapter = \"full\"")
        return model

    def report_targets(self, model, ctx) -> None:
        """Say what the adapter adapts, read from the wrapped model (``apply`` calls it after peft has
        wrapped the model, before the trainable count). Nothing by default."""

    def save(self, model, path):
        model.save_pretrained(path)  # adapter weights only, as safetensors

    def restore(self, base, path, ctx):
        from peft import PeftModel

        model = expose_head_bias(PeftModel.from_pretrained(base, path, is_trainable=True))
        enable_grouped_experts(model)
        return model

    def merge(self, model):
        merged = model.merge_and_unload()
        disable_grouped_experts(merged)  # no factors left to hand over: transformers' own experts forward again
        return merged


class LoraCommonOptions(Options):
    """What every LoRA variant takes (peft's LoraConfig names)."""

    r: int = Field(8, gt=0)
    lora_alpha: int = Field(16, gt=0)
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: TargetModules = "all-linear"
    # Parameters adapted besides the target_modules (peft's target_parameters): unset, the preset's (a
    # mixture-of-experts model's expert weights, under all-linear and mlp); a list names them; [] for none.
    target_parameters: list[str] | None = None
    bias: Literal["none", "all", "lora_only"] = "none"
    modules_to_save: list[str] | None = None
    # A vision-language model: LoRA adapts its language model only; these adapt the vision tower too, or
    # train the projector (between tower and language model) whole. Both are frozen otherwise.
    vision_tower: bool = False
    train_projector: bool = False
    # Also train the rows of the chat template's tokens that the tokenizer had already (peft's trainable
    # tokens, as for tokens the template adds): for markers no data has trained, such as a base model's
    # chat tokens or a scratch tokenizer's; on the quickstart, chatml's end-of-turn is otherwise never
    # learned under LoRA (benchmarks/RESULTS.md, new-token templates against chatml).
    train_template_tokens: bool = False


class LoraOptions(LoraCommonOptions):
    use_rslora: bool = False


class LoraAdapter(PeftAdapter):
    """LoRA (peft): trains low-rank updates to the chosen linear layers."""

    name = "lora"
    Options = LoraOptions

    def lora_kwargs(self) -> dict[str, Any]:
        """What a variant adds to or changes in the LoraConfig."""
        return {"use_rslora": getattr(self.options, "use_rslora", False)}

    def label(self) -> str:
        return f"adapter {self.name} (r={self.options.r})"

    def apply_meta(self, model, ctx):
        """For ``ftcore estimate``: the adapter's layers on the meta model. An initialisation that reads
        the weights (PiSSA's SVD, OLoRA's QR, LoftQ) cannot run on meta tensors, and changes no shape or
        dtype, so the layers are made with peft's default initialisation, on the meta device too: made on
        the CPU and initialised, a 70B model's adapter took 5 s per estimate."""
        from peft import get_peft_model

        config = self.peft_config(model, ctx)
        config.init_lora_weights = True
        config.loftq_config = {}
        model = get_peft_model(model, config, low_cpu_mem_usage=True)
        enable_grouped_experts(model)  # the estimate counts what the experts' LoRA then saves
        return model

    def peft_config(self, model, ctx):
        from peft import LoraConfig

        from ftcore_plugins.adapters._targets import (check_modules_to_save, check_rank, peft_renames, resolve,
                                                      shortest_names)

        o = self.options
        targets = resolve(model, o.target_modules, vision=o.vision_tower, target_parameters=o.target_parameters)
        check_rank(model, targets, o.r)
        check_modules_to_save(model, o.modules_to_save)
        kwargs = self.lora_kwargs()
        # Names peft's transformers-5 conversion would take for the fused experts' (a dense MLP's gate_proj, the
        # shared expert's) are handed over as those layers' weights instead, which it leaves as they are.
        renamed = peft_renames(model, targets.names)
        names = [n for n in targets.names if n not in renamed]
        parameters = targets.parameter_names + [f"{n}.weight" for n in renamed]
        if parameters:
            self.check_parameters(model, targets, renamed, kwargs)
        every = [p for p, _ in model.named_modules() if p]
        short = shortest_names(list(targets.frozen), every)
        self._frozen = {p: (next(n for n in short if p == n or p.endswith("." + n)), why)
                        for p, why in targets.frozen.items()}
        self._requested = (targets.modules, targets.parameters)
        save = o.modules_to_save
        if o.train_projector or o.vision_tower:
            from ftcore_plugins.adapters._targets import vision_parts

            tower, projector = vision_parts(model)
            if not tower:
                raise FtcoreError(f"adapter {self.name}: vision_tower and train_projector are for vision-language "
                                  "models, and this one has no vision tower")
            if o.train_projector:
                save = [*(save or []), *projector]
        return LoraConfig(task_type=peft_task_type(model), r=o.r, lora_alpha=o.lora_alpha, lora_dropout=o.lora_dropout,
                          target_modules=names, target_parameters=parameters or None,
                          fan_in_fan_out=targets.conv1d, bias=o.bias, modules_to_save=save, **kwargs)

    def check_parameters(self, model, targets, renamed: list[str], kwargs: dict[str, Any]) -> None:
        """Refuse, in one line, what peft's LoRA on parameters (``ParamWrapper``) cannot do: DoRA, an
        initialisation that reads a layer's weight matrix (PiSSA, OLoRA, LoftQ; an experts module has
        none), dropout (peft's ``ParamWrapper`` refuses it, so its adapter file would not load in plain peft, though
        ftcore's grouped path has an adapter input to drop)."""
        from ftcore_plugins.adapters._targets import parameter_names

        model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        init = kwargs.get("init_lora_weights")
        why = ("peft's DoRA has no version for parameters" if kwargs.get("use_dora") else
               f"peft's {init} initialisation reads a layer's weight matrix" if isinstance(init, str) else None)
        if why is None and self.options.lora_dropout == 0:
            return
        what, fixes = [], []
        if targets.parameters:
            what.append(f"parameters ({', '.join(parameter_names(targets.parameters, model))})")
            fixes.append("target_parameters = []")
        if renamed:
            what.append(f"{', '.join(renamed)}, which peft adapts as parameters on this model (its transformers-5 "
                        "conversion takes those names for the fused experts')")
            fixes.append("a target_modules without them, e.g. \"attention\",")
        key, what, fix = ("target_parameters" if targets.parameters else "target_modules"), " and ".join(what), \
            " and ".join(fixes)
        if why is not None:
            raise FtcoreError(f"adapter {key}: {self.name} cannot adapt parameters ({why}), and this {model_type} "
                              f"model's targets include {what}; use adapter \"lora\" (or {fix} to leave them frozen)")
        raise FtcoreError(f"adapter lora_dropout: peft's LoRA on parameters takes no dropout, and this {model_type} "
                          f"model's targets include {what}; set lora_dropout = 0 (or {fix} to leave them frozen)")

    def report_targets(self, model, ctx):
        """The targets line, read back from what peft adapted; a warning for any target peft did not adapt."""
        from ftcore_plugins.adapters._targets import adapted, describe_adapted

        name = model.active_adapter
        ctx.reporter.info(f"adapter {self.name}: targets {describe_adapted(model, getattr(self, '_frozen', {}), name)}")
        modules, parameters = getattr(self, "_requested", ([], []))
        layers, params = adapted(model, name)
        wrapped = set(layers) | {p.rpartition(".")[0] for p in params}
        missed = [m for m in modules if m not in wrapped] + [p for p in parameters if p not in params]
        if missed:
            ctx.reporter.warn(f"adapter {self.name}: peft left {len(missed)} of the targets without an adapter "
                              f"({', '.join(missed[:4])}{', ...' if len(missed) > 4 else ''}); they stay frozen")


@ftcore.hookimpl
def register_adapters(register):
    register(LoraAdapter)
