"""Trainer ``sft``: supervised fine-tuning on chat rows with TRL's SFTTrainer, assistant-only loss."""

from __future__ import annotations

import ftcore
from ftcore.component import Component
from ftcore.errors import FtcoreError

from ._chat import encode
from ._training import TrainOptions, run_trl, to_dataset


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
        sets = []
        for label, rows in (("train", ctx.train_data), ("eval", ctx.eval_data)):
            if rows is None:
                sets.append(None)
                continue
            columns, stats = encode(rows, ctx.tokenizer, ctx.template, max_length=o.max_length,
                                    train_on_inputs=o.train_on_inputs, reporter=ctx.reporter,
                                    description=f"tokenize {label}")
            ctx.reporter.info(f"{label}: {stats.kept:,} samples, {stats.tokens:,} tokens, "
                              f"{stats.label_tokens:,} trained on; {stats.truncated} truncated, "
                              f"{stats.dropped_no_labels} dropped with nothing to learn")
            ctx.reporter.log(ctx.stage, {f"data/{label}_samples": stats.kept, f"data/{label}_tokens": stats.tokens,
                                         f"data/{label}_label_tokens": stats.label_tokens,
                                         f"data/{label}_truncated": stats.truncated,
                                         f"data/{label}_dropped": stats.dropped_no_labels})
            if not stats.kept:
                raise FtcoreError(f"stage {ctx.stage}: no {label} sample has a token to learn after masking "
                                  f"and truncation to max_length={o.max_length}")
            sets.append(to_dataset(columns))
        return run_trl(ctx, o, sets[0], sets[1], packing=False)


@ftcore.hookimpl
def register_trainers(register):
    register(SFTTrainer)
