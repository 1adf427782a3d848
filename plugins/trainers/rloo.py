"""Trainer ``rloo``: REINFORCE Leave-One-Out with TRL's RLOOTrainer, scored by the plan's reward
functions and/or an earlier reward-model stage."""

from __future__ import annotations

from pydantic import Field

import ftcore
from ftcore.component import Component

from ftcore_plugins.trainers._online import OnlineOptions, check_online, train_online


class RLOOTrainer(Component):
    """RLOO (TRL RLOOTrainer): each completion's baseline is the mean reward of the other completions of
    its prompt; the KL to the starting policy is a reward penalty."""

    name = "rloo"

    class Options(OnlineOptions):
        beta: float = Field(0.05, ge=0)  # KL penalty subtracted from the reward; 0 loads no reference model
        normalize_advantages: bool = False  # scale advantages to mean 0, std 1 per generation batch

    def check(self, plan) -> list[str]:
        return check_online(self, plan)

    def train(self, ctx):
        from trl import RLOOConfig, RLOOTrainer as TRLRLOOTrainer

        o = self.options
        return train_online(self, ctx, TRLRLOOTrainer, RLOOConfig,
                            dict(beta=o.beta, normalize_advantages=o.normalize_advantages))


@ftcore.hookimpl
def register_trainers(register):
    register(RLOOTrainer)
