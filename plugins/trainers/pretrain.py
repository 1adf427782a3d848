"""Trainer ``pretrain``: causal language modelling on plain text, documents concatenated into blocks."""

from __future__ import annotations

import ftcore
from ftcore.component import Component
from ftcore.errors import FtcoreError

from ftcore_plugins.common.estimate import TrainerMemory
from ftcore_plugins.trainers._training import TrainChecks, TrainOptions, run_trl, tokenize_splits


class PretrainTrainer(TrainChecks, TrainerMemory, Component):
    """Causal-LM pre-training on text: every token is trained on, EOS between documents."""

    name = "pretrain"

    class Options(TrainOptions):
        learning_rate: float = 1e-3

    def train(self, ctx):
        o = self.options
        if "text" not in ctx.train_data.column_names:
            raise FtcoreError(f"stage {ctx.stage}: trainer 'pretrain' needs plain-text rows; "
                              "this data is chat: use trainer = \"sft\"")
        train, evaluation = tokenize_splits(ctx, max_length=None, batch_size=o.batch_size)  # packing cuts blocks
        # "wrapped" packing: concatenate documents and cut max_length blocks, no padding.
        return run_trl(ctx, o, train, evaluation, packing=True, packing_strategy="wrapped")


@ftcore.hookimpl
def register_trainers(register):
    register(PretrainTrainer)
