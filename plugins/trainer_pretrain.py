"""Trainer ``pretrain``: causal language modelling on plain text, documents concatenated into blocks."""

from __future__ import annotations

import ftcore
from ftcore.component import Component
from ftcore.errors import FtcoreError

from ._chat import encode
from ._training import TrainOptions, run_trl, to_dataset


class PretrainTrainer(Component):
    """Causal-LM pre-training on text: every token is trained on, EOS between documents."""

    name = "pretrain"

    class Options(TrainOptions):
        learning_rate: float = 1e-3

    def train(self, ctx):
        o = self.options
        if "text" not in ctx.train_data.column_names:
            raise FtcoreError(f"stage {ctx.stage}: trainer 'pretrain' needs plain-text rows; "
                              "this data is chat: use trainer = \"sft\"")
        sets = []
        for label, rows in (("train", ctx.train_data), ("eval", ctx.eval_data)):
            if rows is None:
                sets.append(None)
                continue
            columns, stats = encode(rows, ctx.tokenizer, ctx.template, max_length=None, reporter=ctx.reporter,
                                    description=f"tokenize {label}")
            ctx.reporter.info(f"{label}: {stats.kept:,} documents, {stats.tokens:,} tokens")
            ctx.reporter.log(ctx.stage, {f"data/{label}_documents": stats.kept, f"data/{label}_tokens": stats.tokens})
            sets.append(to_dataset(columns))
        # "wrapped" packing: concatenate documents and cut max_length blocks, no padding.
        return run_trl(ctx, o, sets[0], sets[1], packing=True, packing_strategy="wrapped")


@ftcore.hookimpl
def register_trainers(register):
    register(PretrainTrainer)
