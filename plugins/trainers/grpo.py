"""Trainer ``grpo``: Group Relative Policy Optimization with TRL's GRPOTrainer, scored by the plan's
reward functions and/or an earlier reward-model stage."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

import ftcore
from ftcore.component import Component

from ftcore_plugins.trainers._online import OnlineOptions, check_online, train_online


class GRPOTrainer(Component):
    """GRPO (TRL GRPOTrainer): samples num_generations completions per prompt and pushes up those that score
    above their group's mean."""

    name = "grpo"

    class Options(OnlineOptions):
        beta: float = Field(0.0, ge=0)  # KL coefficient; 0 loads no reference model
        loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"] = "dapo"
        scale_rewards: Literal["group", "batch", "none"] = "group"  # divide advantages by the reward std
        importance_sampling_level: Literal["token", "sequence"] = "token"  # "sequence": GSPO

    def check(self, plan) -> list[str]:
        problems = check_online(self, plan)
        if self.options.loss_type == "luspo" and self.options.importance_sampling_level != "sequence":
            problems.append("loss_type: 'luspo' needs importance_sampling_level = \"sequence\"")
        return problems

    def train(self, ctx):
        from trl import GRPOConfig, GRPOTrainer as TRLGRPOTrainer

        o = self.options
        return train_online(self, ctx, TRLGRPOTrainer, GRPOConfig,
                            dict(beta=o.beta, loss_type=o.loss_type, scale_rewards=o.scale_rewards,
                                 importance_sampling_level=o.importance_sampling_level))


@ftcore.hookimpl
def register_trainers(register):
    register(GRPOTrainer)
