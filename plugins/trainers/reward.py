"""Trainer ``reward``: a reward model (a sequence-classification head with one output on a copy of
the policy) trained on preference pairs with TRL's RewardTrainer. It trains a separate model: the
policy passes on unchanged, and the merged reward model is saved, with the tokenizer, to the
stage's ``output/`` folder, where ``AutoModelForSequenceClassification.from_pretrained`` loads it
(a later PPO stage names this stage to score with it)."""

from __future__ import annotations

import copy
import dataclasses

from pydantic import Field

import ftcore
from ftcore.component import Component
from ftcore.errors import FtcoreError
from ftcore.types import LearningRate

from ftcore_plugins.common.preference import pair_metrics, render
from ftcore_plugins.trainers._preference import check_data, length_report, periodic_evaluation, require_data
from ftcore_plugins.trainers._training import TrainOptions

HEAD_NAMES = ("score", "classifier")  # the head of transformers' *ForSequenceClassification models


class RewardTrainer(Component):
    """Reward model (TRL RewardTrainer): scores a prompt+answer; trained so chosen beats rejected."""

    name = "reward"
    supports_images = False  # rows with images are refused in one line (not done yet: docs/vision.md)
    trains_policy = False

    class Options(TrainOptions):
        learning_rate: LearningRate = 1e-5  # full fine-tuning; LoRA usually wants ~1e-4
        center_rewards_coefficient: float | None = Field(None, ge=0)  # pulls the mean reward to 0 (e.g. 0.01)

    def check(self, plan):
        problems = check_data(self, plan, ("pairs",))
        if plan.quantizer.name != "none":
            problems.append(f"trainer 'reward' builds the reward model from a copy of the policy's weights, which "
                            f"it cannot do from quantizer '{plan.quantizer.name}' weights; use [quantizer] "
                            "use = \"none\" (LoRA with gradient_checkpointing = true is the smallest alternative)")
        return problems

    def train(self, ctx):
        from trl import RewardConfig
        from trl import RewardTrainer as TrlRewardTrainer

        from ftcore_plugins.trainers._training import run_trainer

        o = self.options
        require_data(ctx, self.name, ("pairs",))
        texts = {"train": render(ctx, ctx.train_data, strip_bos=False),
                 "eval": render(ctx, ctx.eval_data, strip_bos=False) if ctx.eval_data is not None else None}
        # The text as the template renders it (as SFT trains on it); TRL drops pairs over max_length.
        ids = length_report(ctx, texts, o.max_length, style="plain", drops_whole_row=True)
        pairs = {label: [{"chosen_ids": p + a[0], "rejected_ids": p + a[1]} for p, a in rows
                         if len(p) + max(map(len, a)) <= o.max_length] for label, rows in ids.items()}
        model = reward_model(ctx)
        sctx = dataclasses.replace(ctx, model=model)  # run_trainer trains ctx.model: the policy stays as it was
        before = scores(model, pairs.get("eval"), o.batch_size)

        import datasets

        _, metrics = run_trainer(sctx, o, TrlRewardTrainer, RewardConfig,
                                 train=datasets.Dataset.from_list(pairs["train"]),
                                 evaluation=datasets.Dataset.from_list(pairs["eval"])
                                 if periodic_evaluation(o) and pairs.get("eval") else None,
                                 config={"max_length": o.max_length, "dataset_num_proc": None,
                                         "center_rewards_coefficient": o.center_rewards_coefficient,
                                         "gradient_checkpointing": o.gradient_checkpointing},
                                 router_aux=False)  # a classification head returns no router loss
        model = sctx.model
        metrics.pop("eval_perplexity", None)  # exp of a pairwise loss is no perplexity
        if before is not None:
            after = scores(model, pairs["eval"], o.batch_size)
            metrics["eval_pairs"] = len(pairs["eval"])
            metrics.update({f"{k}_before": v for k, v in pair_metrics("eval_", *before).items()})
            metrics.update(pair_metrics("eval_", *after))
            ctx.reporter.log(ctx.stage, {k: v for k, v in metrics.items() if k.startswith("eval_")},
                             step=metrics.get("global_step"))
        from peft import PeftModel

        if isinstance(model, PeftModel):
            model = ctx.adapter.merge(model)
        if ctx.run.is_main:
            model.save_pretrained(ctx.output)  # safetensors, the full model
            ctx.tokenizer.save_pretrained(ctx.output)
        return metrics


def reward_model(ctx):
    """A sequence-classification model with one output on a copy of the policy's weights (an adapter
    the policy carries merged), with the stage's adapter applied and the new head trainable."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    from ftcore.context import AdapterContext

    policy = ctx.model
    if getattr(policy, "is_quantized", False) or getattr(policy, "is_loaded_in_4bit", False) \
            or getattr(policy, "is_loaded_in_8bit", False):
        raise FtcoreError(f"stage {ctx.stage}: trainer 'reward' copies the policy's weights into a new model, "
                          "which it cannot do from quantized weights; use [quantizer] use = \"none\"")
    if isinstance(policy, PeftModel):
        policy = copy.deepcopy(policy).merge_and_unload()
    config = copy.deepcopy(policy.config)
    config.num_labels = 1
    config.pad_token_id = ctx.tokenizer.pad_token_id if ctx.tokenizer.pad_token_id is not None \
        else ctx.tokenizer.eos_token_id  # the head reads the last token that is not padding
    with torch.random.fork_rng():
        torch.manual_seed(ctx.seed)  # the head's initialisation; a resumed run starts the same
        model = AutoModelForSequenceClassification.from_config(config, dtype=policy.dtype)
    body = model.base_model_prefix
    getattr(model, body).load_state_dict(getattr(policy, body).state_dict())
    model.to(next(policy.parameters()).device)
    actx = AdapterContext(ctx.run, ctx.reporter, None)
    peft_config = getattr(ctx.adapter, "peft_config", None)
    if peft_config is None:  # full or partial fine-tuning of the model itself
        model = ctx.adapter.apply(model, actx)
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in HEAD_NAMES:  # the new head trains, whatever else does
                module.requires_grad_(True)
        return model
    # A peft adapter, configured for sequence classification: peft then trains the head whole
    # (modules_to_save), so it must not be one of the adapter's low-rank targets too.
    from peft import get_peft_model

    from ftcore_plugins.common.model import report_trainable

    config = peft_config(model, actx)
    config.task_type = "SEQ_CLS"
    if isinstance(config.target_modules, (list, set)):
        config.target_modules = [t for t in config.target_modules if t.rsplit(".", 1)[-1] not in HEAD_NAMES]
    with torch.random.fork_rng():
        torch.manual_seed(ctx.adapter.init_seed(ctx.seed))
        model = get_peft_model(model, config)
    report = getattr(ctx.adapter, "report_targets", None)  # what peft adapted, read back (the adapters' own line)
    if report is not None:
        report(model, actx)
    report_trainable(model, ctx.reporter, f"{ctx.adapter.label()} and the reward head")
    return model


def scores(model, pairs, batch_size):
    """The reward of every chosen and rejected sequence: two tensors, or None without pairs."""
    import torch

    if not pairs:
        return None
    seqs = [p[k] for p in pairs for k in ("chosen_ids", "rejected_ids")]
    pad, device = model.config.pad_token_id, next(model.parameters()).device
    was_training, out = model.training, []
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(seqs), batch_size):
                chunk = seqs[start:start + batch_size]
                width = max(map(len, chunk))
                input_ids = torch.tensor([s + [pad] * (width - len(s)) for s in chunk], device=device)
                mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in chunk], device=device)
                out.append(model(input_ids=input_ids, attention_mask=mask).logits[:, 0].float().cpu())
    finally:
        model.train(was_training)
    both = torch.cat(out).view(-1, 2)
    return both[:, 0], both[:, 1]


@ftcore.hookimpl
def register_trainers(register):
    register(RewardTrainer)
