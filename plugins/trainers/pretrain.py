"""Trainer ``pretrain``: causal language modelling on plain text, documents concatenated into blocks.

It is ``SFT`` with other data and packing: the same override points apply to a subclass of it."""

from __future__ import annotations

from typing import Any

import ftcore
from ftcore.errors import FtcoreError
from ftcore.types import LearningRate

from ftcore_plugins.trainers._loss import LossOptions
from ftcore_plugins.trainers._training import TrainOptions, tokenize_splits
from ftcore_plugins.trainers.sft import SFT


class PretrainOptions(TrainOptions, LossOptions):
    """The ``pretrain`` stage's options: the shared training options and the loss's, with a higher learning rate."""

    learning_rate: LearningRate = 1e-3


class Pretrain(SFT):
    """Causal-LM pre-training on text: every token is trained on, EOS between documents."""

    name = "pretrain"
    Options = PretrainOptions
    encoder_decoder = False  # causal language modelling: refused on T5/BART at validation
    supports_images = False  # plain text: rows with images are refused in one line

    def prepare_data(self, ctx: Any) -> tuple[Any, Any]:
        if "text" not in ctx.train_data.column_names:
            raise FtcoreError(f"stage {ctx.stage}: trainer '{self.name}' needs plain-text rows; "
                              "this data is chat: use trainer = \"sft\"")
        return tokenize_splits(ctx, max_length=None, batch_size=self.options.batch_size)  # packing cuts blocks

    def trl_config(self, ctx: Any) -> dict[str, Any]:
        # "wrapped" packing: concatenate documents and cut max_length blocks, no padding.
        return {"packing": True, "packing_strategy": "wrapped"}


PretrainTrainer = Pretrain  # the name before Pretrain became public; kept for existing imports


@ftcore.hookimpl
def register_trainers(register):
    register(Pretrain)
