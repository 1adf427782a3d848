"""Evaluator ``preference``: on held-out preference pairs, how often the chosen answer wins and by
how much, judged by the policy's log-probabilities (optionally against a reference, DPO-style) or
by a reward model an earlier ``reward`` stage trained."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Literal

from pydantic import Field

import ftcore
from ftcore.component import Component, Options
from ftcore.errors import FtcoreError
from ftcore.types import Tokens

from ftcore_plugins.common import reward_model as _reward_model
from ftcore_plugins.common.preference import answer_logps, pair_metrics, render, tokenize
from ftcore_plugins.common.seq2seq import plan_encoder_decoder, refusal
from ftcore_plugins.evaluators._baseline import model_ready_problems


class Preference(Component):
    """Chosen-vs-rejected accuracy and margin on held-out pairs."""

    name = "preference"

    class Options(Options):
        # logprob: summed log-probability of each answer under the model (minus the reference's,
        # times beta, when ``reference`` is set: DPO's implicit reward). reward_model: the score of a
        # reward model an earlier stage trained.
        method: Literal["logprob", "reward_model"] = "logprob"
        reference: str | None = None  # logprob: "base" or a stage name, for the implicit reward
        beta: float = Field(0.1, gt=0)  # logprob with a reference: reward = beta * (log p - log p_ref)
        reward_model: str | None = None  # reward_model: the name of a finished `reward` stage
        batch_size: int = Field(8, ge=1, le=1 << 16)
        max_length: Tokens = 512  # prompt + answer, in tokens; longer pairs are cut, pairs whose prompt fills it skipped

    def check(self, plan) -> list[str]:
        o = self.options
        if family := plan_encoder_decoder(plan):
            return [refusal(f"evaluator '{self.name}'", family, "it scores answers by a causal LM's log-probabilities "
                            "after the prompt", "use \"perplexity\" or \"exact_match\"")]
        if o.method == "reward_model":
            if o.reward_model is None:
                return ["reward_model: method = \"reward_model\" needs the name of a `reward` stage"]
            if o.reference is not None:
                return ["reference: only used with method = \"logprob\""]
            stage = next((s for s in plan.stages if s.name == o.reward_model), None)
            if stage is not None and stage.trainer.name != "reward":
                return [f"reward_model: stage {o.reward_model!r} trains with '{stage.trainer.name}', "
                        "not 'reward'; name a `reward` stage"]
            if o.reward_model == "base":
                return ["reward_model: name a `reward` stage, not \"base\""]
            return model_ready_problems(plan, self, "reward_model", o.reward_model)
        if o.reward_model is not None:
            return ["reward_model: set method = \"reward_model\" to judge by a reward model"]
        return model_ready_problems(plan, self, "reference", o.reference)

    def evaluate(self, ctx):
        import torch

        data = ctx.data
        if data is None or not {"prompt", "chosen", "rejected"} <= set(data.column_names):
            raise FtcoreError("evaluator 'preference' needs preference pairs (prompt, chosen, rejected) as its data")
        o = self.options
        view = SimpleNamespace(tokenizer=ctx.tokenizer, template=ctx.template, stage=f"evaluate {self.name}")
        texts = render(view, data, strip_bos=False)  # the prompt with the generation prompt, each answer after it
        if o.method == "reward_model":
            folder = ctx.outputs.get(o.reward_model)
            if folder is None:
                raise FtcoreError(f"evaluator 'preference': stage {o.reward_model!r} has not finished")
            device = next(ctx.model.parameters()).device
            model, tokenizer = _reward_model.load(folder, device, f"evaluate {self.name}", o.reward_model)
            prompts = list(texts["prompt"])
            chosen = _reward_model.scores(model, tokenizer, [p + a for p, a in zip(prompts, texts["chosen"])],
                                          device, o.batch_size)
            rejected = _reward_model.scores(model, tokenizer, [p + a for p, a in zip(prompts, texts["rejected"])],
                                            device, o.batch_size)
            return {**pair_metrics("", torch.tensor(chosen), torch.tensor(rejected)), "pairs": len(chosen)}

        ids = tokenize(ctx.tokenizer, texts, style="plain")
        pad = ctx.tokenizer.pad_token_id if ctx.tokenizer.pad_token_id is not None else ctx.tokenizer.eos_token_id
        logps = answer_logps(ctx.model, ids, o.max_length, pad, o.batch_size)[..., 0]  # (pairs, 2)
        if not len(logps):
            raise FtcoreError(f"evaluator 'preference': every prompt fills max_length = {o.max_length}")
        if o.reference is not None:
            reference, _ = ctx.load_model(o.reference)
            try:
                logps = o.beta * (logps - answer_logps(reference, ids, o.max_length, pad, o.batch_size)[..., 0])
            finally:
                del reference
        return {**pair_metrics("", logps[:, 0], logps[:, 1]), "pairs": int(logps.shape[0])}


@ftcore.hookimpl
def register_evaluators(register):
    register(Preference)
