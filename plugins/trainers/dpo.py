"""Trainer ``dpo``: Direct Preference Optimization (TRL DPOTrainer) on preference pairs, against
the policy as it was when the stage started. Pairs with images train a vision-language model through
TRL's vision collator (trainers/_vision.py; docs/vision.md)."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

import ftcore
from ftcore.component import Component
from ftcore.types import LearningRate

from ftcore_plugins.trainers._padding_free import padding_free_problems, with_padding_free
from ftcore_plugins.trainers._preference import check_data, train_against_reference
from ftcore_plugins.trainers._training import TrainOptions

# What TRL 1.16's DPOConfig.loss_type accepts (trl/trainer/dpo_config.py).
LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
              "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")


class DPOTrainer(Component):
    """Direct Preference Optimization (TRL DPOTrainer) on preference pairs."""

    name = "dpo"
    supports_images = True  # pairs with images train through TRL's vision collator (trainers/_vision.py)

    class Options(TrainOptions):
        learning_rate: LearningRate = 5e-6  # DPO moves a trained policy a little: 5e-7..5e-6 full, ~5e-6..5e-5 LoRA
        beta: float = Field(0.1, gt=0)  # how far from the reference the policy may move (higher: less)
        loss_type: str | list[str] = "sigmoid"  # one of LOSS_TYPES, or several combined with loss_weights
        loss_weights: list[float] | None = None
        label_smoothing: float = Field(0.0, ge=0.0, lt=1.0)  # robust: flip probability < 0.5; exo_pair: > 0
        padding_free: bool = False  # a batch's chosen and rejected sequences as one row, no padding

        @field_validator("loss_type")
        @classmethod
        def _known(cls, value):
            for loss in [value] if isinstance(value, str) else value:
                if loss not in LOSS_TYPES:
                    raise ValueError(f"unknown DPO loss {loss!r}; TRL offers: {', '.join(LOSS_TYPES)}")
            return value

        @model_validator(mode="after")
        def _consistent(self):
            losses = [self.loss_type] if isinstance(self.loss_type, str) else self.loss_type
            if self.loss_weights is not None and len(self.loss_weights) != len(losses):
                raise ValueError(f"loss_weights has {len(self.loss_weights)} weights for {len(losses)} loss types")
            if "exo_pair" in losses and self.label_smoothing == 0:
                raise ValueError("loss_type 'exo_pair' needs label_smoothing > 0 (the EXO paper uses 1e-3)")
            if "robust" in losses and self.label_smoothing >= 0.5:
                raise ValueError("loss_type 'robust' needs label_smoothing < 0.5 (a label-flip probability)")
            return self

    def check(self, plan):
        return check_data(self, plan, ("pairs",)) + padding_free_problems(self, plan)

    def train(self, ctx):
        from trl import DPOConfig
        from trl import DPOTrainer as TrlDPOTrainer

        o = self.options
        losses = [o.loss_type] if isinstance(o.loss_type, str) else list(o.loss_type)
        trainer_cls = with_padding_free(TrlDPOTrainer) if o.padding_free else TrlDPOTrainer
        return train_against_reference(ctx, o, self.name, trainer_cls, DPOConfig,
                                       {"loss_type": losses, "loss_weights": o.loss_weights,
                                        "label_smoothing": o.label_smoothing},
                                       ("pairs",), check_reference=reference_gap, images=True)


def reference_gap(trainer, ids, start):
    """The largest difference between the log-probabilities TRL's reference gives the held-out
    answers and the policy's when the stage started: the reference must be that policy."""
    import torch

    max_length = trainer.args.max_length
    rows = [{"prompt_ids": p, "chosen_ids": a[0], "rejected_ids": a[1]} for p, a in ids if len(p) < max_length]
    gaps = []
    for begin in range(0, len(rows), trainer.args.per_device_eval_batch_size):
        batch = trainer.data_collator(rows[begin:begin + trainer.args.per_device_eval_batch_size])
        batch = {k: v.to(trainer.accelerator.device) for k, v in batch.items()}
        # As TRL's own precompute calls it: the reference model, or the peft model (its `ref` adapter).
        chosen, rejected = trainer.compute_ref_log_probs(trainer.ref_model or trainer.model, batch)
        gaps.append(torch.stack([chosen, rejected], -1).float().cpu())
    return {"reference_logp_max_diff": (torch.cat(gaps) - start[..., 0]).abs().max().item()}


@ftcore.hookimpl
def register_trainers(register):
    register(DPOTrainer)
