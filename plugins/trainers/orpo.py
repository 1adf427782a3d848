"""Trainer ``orpo``: Odds Ratio Preference Optimization (TRL's experimental ORPOTrainer): SFT on the
chosen answers plus an odds-ratio penalty on the rejected ones, with no reference model.

TRL keeps ORPO in ``trl.experimental``, whose API may change between releases; this module is the
only one that imports it, so such a change breaks this trainer alone, with a one-line error."""

from __future__ import annotations

from pydantic import Field

import ftcore
from ftcore.component import Component
from ftcore.errors import FtcoreError
from ftcore.types import LearningRate

from ftcore_plugins.common.preference import answer_logps, pair_metrics, render
from ftcore_plugins.trainers._padding_free import padding_free_problems, with_padding_free
from ftcore_plugins.trainers._preference import check_data, length_report, periodic_evaluation, require_data
from ftcore_plugins.trainers._training import TrainOptions


class ORPOTrainer(Component):
    """Odds Ratio Preference Optimization (TRL experimental ORPOTrainer) on preference pairs."""

    name = "orpo"
    supports_images = False  # rows with images are refused in one line (not done yet: docs/vision.md)

    class Options(TrainOptions):
        learning_rate: LearningRate = 5e-6  # the ORPO paper: 5e-6..8e-6 full fine-tuning
        beta: float = Field(0.1, gt=0)  # lambda in the paper: weight of the odds-ratio term against the SFT loss
        padding_free: bool = False  # a batch's chosen and rejected sequences as one row, no padding

    def check(self, plan):
        return check_data(self, plan, ("pairs",)) + padding_free_problems(self, plan)

    def train(self, ctx):
        import trl

        from ftcore_plugins.trainers._training import run_trainer

        try:
            from trl.experimental.orpo import ORPOConfig
            from trl.experimental.orpo import ORPOTrainer as TrlORPOTrainer
        except ImportError as exc:
            raise FtcoreError(f"trainer 'orpo' (ftcore_plugins.trainers.orpo) cannot import ORPOTrainer from "
                              f"trl.experimental.orpo in trl {trl.__version__}: {exc}; install a trl release that "
                              "has it") from None
        o = self.options
        require_data(ctx, self.name, ("pairs",))
        # ORPO tokenizes without the tokenizer's special tokens and adds BOS itself when missing.
        train = render(ctx, ctx.train_data, strip_bos=False)
        evaluation = render(ctx, ctx.eval_data, strip_bos=False) if ctx.eval_data is not None else None
        ids = length_report(ctx, {"train": train, "eval": evaluation}, o.max_length, style="orpo")
        # TRL's ORPO keeps a row whose prompt alone fills max_length, with an empty answer whose mean
        # log-probability is 0/0: a NaN loss. Drop those rows, as TRL's DPO and KTO do and the report says.
        train = fitting(train, ids["train"], o.max_length)
        evaluation = fitting(evaluation, ids.get("eval"), o.max_length)
        pad = ctx.tokenizer.pad_token_id if ctx.tokenizer.pad_token_id is not None else ctx.tokenizer.eos_token_id

        def measure(suffix: str) -> dict:
            # ORPO's reward: beta * the answer's mean log-probability per token.
            logps = answer_logps(ctx.model, ids["eval"], o.max_length, pad, o.batch_size)
            reward = o.beta * logps[..., 0] / logps[..., 1].clamp(min=1)
            found = pair_metrics("eval_reward_", reward[:, 0], reward[:, 1])
            return {f"{k}{suffix}": v for k, v in found.items()} | {"eval_pairs": int(reward.shape[0])}

        before = measure("_before") if "eval" in ids else {}
        # Padding-free, TRL's logits/* (a mean over every position, padding included) would not be true.
        trainer_cls = with_padding_free(TrlORPOTrainer, hide=("logits/chosen", "logits/rejected")) \
            if o.padding_free else TrlORPOTrainer
        trainer_cls = with_aux_loss_logged(trainer_cls)
        trainer, metrics = run_trainer(ctx, o, trainer_cls, ORPOConfig, train=train,
                                 evaluation=evaluation if periodic_evaluation(o) else None,
                                 config={"max_length": o.max_length, "beta": o.beta, "dataset_num_proc": None,
                                         "gradient_checkpointing": o.gradient_checkpointing,
                                         "remove_unused_columns": False})  # its collator needs every column
        metrics.pop("eval_perplexity", None)  # exp of the ORPO loss is no perplexity
        metrics.update(getattr(trainer, "padding_free_counts", {}))
        if before:
            metrics.update(before, **measure(""))
            ctx.reporter.log(ctx.stage, {k: v for k, v in metrics.items() if k.startswith("eval_")},
                             step=metrics.get("global_step"))
        return metrics


def with_aux_loss_logged(trainer_cls: type) -> type:
    """TRL's ORPOTrainer, which adds the router's loss where the model's config asks for it (run_trainer sets it
    by the stage's router_aux_loss_coef) but does not log it, logging it as ``aux_loss`` as the other trainers do."""

    class LoggedAux(trainer_cls):
        def concatenated_forward(self, model, batch):
            out = super().concatenated_forward(model, batch)
            self._router_aux = out[5] if self.aux_loss_enabled else None
            return out

        def get_batch_loss_metrics(self, model, batch, train_eval="train"):
            loss, metrics = super().get_batch_loss_metrics(model, batch, train_eval)
            if getattr(self, "_router_aux", None) is not None:
                aux = self.accelerator.gather_for_metrics(self._router_aux.detach()).mean().item()
                metrics[f"{'eval_' if train_eval == 'eval' else ''}aux_loss"] = aux
            return loss, metrics

    LoggedAux.__name__ = LoggedAux.__qualname__ = trainer_cls.__name__
    return LoggedAux


def fitting(rows, ids, max_length: int):
    """The rendered rows whose prompt leaves room for an answer within ``max_length``."""
    if rows is None:
        return None
    return rows.select([i for i, (prompt, _) in enumerate(ids) if len(prompt) < max_length])


@ftcore.hookimpl
def register_trainers(register):
    register(ORPOTrainer)
