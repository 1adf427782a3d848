"""Trainer ``sft``: supervised fine-tuning on chat rows with TRL's SFTTrainer, assistant-only loss."""

from __future__ import annotations

from typing import Literal

import ftcore
from ftcore.component import Component
from ftcore.errors import FtcoreError

from ftcore_plugins.common.estimate import TrainerMemory
from ftcore_plugins.trainers._training import TrainChecks, TrainOptions, run_trl, tokenize_splits


class SFTTrainer(TrainChecks, TrainerMemory, Component):
    """Supervised fine-tuning (TRL SFTTrainer); loss on every assistant turn only."""

    name = "sft"

    class Options(TrainOptions):
        train_on_inputs: bool = False  # also train on system/user tokens
        truncation: Literal["truncate_response", "truncate_prompt", "drop"] = "truncate_response"
        packing: bool = False  # best-fit packing, position ids reset per sample (no cross-sample attention)

    def train(self, ctx):
        o = self.options
        ctx.train_data, ctx.eval_data = chosen_as_chat(ctx.train_data), chosen_as_chat(ctx.eval_data)
        columns = set(ctx.train_data.column_names)
        if "messages" not in columns and not {"prompt", "completion"} <= columns:
            raise FtcoreError(f"stage {ctx.stage}: trainer 'sft' needs chat rows (messages, Alpaca, ShareGPT, ...) "
                              f"or prompt/completion rows; this data has {', '.join(sorted(columns))}"
                              + ("; for plain text use trainer = \"pretrain\"" if "text" in columns else ""))
        train, evaluation = tokenize_splits(ctx, max_length=o.max_length, truncation=o.truncation,
                                            train_on_inputs=o.train_on_inputs, batch_size=o.batch_size,
                                            packed_length=o.max_length)
        return run_trl(ctx, o, train, evaluation, packing=o.packing, packing_strategy="bfd")


def chosen_as_chat(data):
    """Preference pairs train SFT on their chosen answers: prompt + chosen as one chat
    (the usual first stage of SFT -> reward model -> PPO)."""
    if data is None or not {"prompt", "chosen"} <= set(data.column_names) or \
            not isinstance(data[0]["prompt"], list):
        return data
    return data.map(lambda row: {"messages": row["prompt"] + row["chosen"]},
                    remove_columns=data.column_names)


@ftcore.hookimpl
def register_trainers(register):
    register(SFTTrainer)
