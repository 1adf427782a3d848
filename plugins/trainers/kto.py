"""Trainer ``kto``: Kahneman-Tversky Optimization (TRL KTOTrainer) on answers labelled desirable or
undesirable, against the policy as it was when the stage started. Preference pairs work too:
each chosen answer counts as desirable and each rejected one as undesirable."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

import ftcore
from ftcore.component import Component
from ftcore.types import LearningRate

from ftcore_plugins.trainers._padding_free import padding_free_problems, with_padding_free
from ftcore_plugins.trainers._preference import check_data, train_against_reference
from ftcore_plugins.trainers._training import TrainOptions

ACCEPTS = ("unpaired", "pairs")


class KTOTrainer(Component):
    """Kahneman-Tversky Optimization (TRL KTOTrainer) on desirable/undesirable answers or pairs."""

    name = "kto"
    supports_images = False  # rows with images are refused in one line (not done yet: docs/vision.md)

    class Options(TrainOptions):
        learning_rate: LearningRate = 5e-6
        beta: float = Field(0.1, gt=0)
        loss_type: Literal["kto", "apo_zero_unpaired"] = "kto"
        desirable_weight: float = Field(1.0, gt=0)  # weigh up the rarer label: see docs/trainers.md
        undesirable_weight: float = Field(1.0, gt=0)
        padding_free: bool = False  # a batch's completions (and their KL pairs) as one row, no padding

    def check(self, plan):
        return check_data(self, plan, ACCEPTS) + padding_free_problems(self, plan)

    def train(self, ctx):
        from trl import KTOConfig
        from trl import KTOTrainer as TrlKTOTrainer

        o = self.options
        trainer_cls = with_padding_free(TrlKTOTrainer) if o.padding_free else TrlKTOTrainer
        return train_against_reference(ctx, o, self.name, trainer_cls, KTOConfig,
                                       {"loss_type": o.loss_type, "desirable_weight": o.desirable_weight,
                                        "undesirable_weight": o.undesirable_weight}, ACCEPTS)


@ftcore.hookimpl
def register_trainers(register):
    register(KTOTrainer)
