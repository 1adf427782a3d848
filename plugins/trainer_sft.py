"""Trainer ``sft``: supervised fine-tuning on chat rows with TRL's SFTTrainer, assistant-only loss."""

from __future__ import annotations

import ftcore
from ftcore.component import Component
from ftcore.errors import FtcoreError

from ._training import TrainOptions, run_trl, tokenize_splits


class SFTTrainer(Component):
    """Supervised fine-tuning (TRL SFTTrainer); loss on every assistant turn only."""

    name = "sft"

    class Options(TrainOptions):
        train_on_inputs: bool = False  # also train on system/user tokens

    def train(self, ctx):
        o = self.options
        if "messages" not in ctx.train_data.column_names:
            raise FtcoreError(f"stage {ctx.stage}: trainer 'sft' needs chat rows (messages, Alpaca, ...); "
                              "this data is plain text: use trainer = \"pretrain\"")
        train, evaluation = tokenize_splits(ctx, max_length=o.max_length, train_on_inputs=o.train_on_inputs)
        return run_trl(ctx, o, train, evaluation, packing=False)


@ftcore.hookimpl
def register_trainers(register):
    register(SFTTrainer)
