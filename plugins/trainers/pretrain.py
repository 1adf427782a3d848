"""Trainer ``pretrain``: causal language modelling on plain text, documents concatenated into blocks.

It is ``SFT`` with other data and packing: the same override points apply to a subclass of it."""

from __future__ import annotations

import math
from typing import Any

import ftcore
from ftcore.errors import FtcoreError
from ftcore.types import LearningRate

from ftcore_plugins.trainers._loss import LossOptions
from ftcore_plugins.trainers._training import TrainOptions, tokenize_splits
from ftcore_plugins.trainers.sft import SFT


# TRL cuts "wrapped" blocks inside each map batch of 1,000 documents: no block spans two batches, and each batch
# ends in a short one. With short documents and a long max_length most rows fell short (the quickstart's 3,000
# documents of 29 tokens at max_length 65,536 gave three rows of about 29k). Where 1,000 documents hold fewer than
# this many blocks, the blocks are cut here first, with TRL's own function, in batches that hold that many.
BLOCKS_A_BATCH = 64
TOKENS_A_BATCH = 1 << 24  # a batch's tokens at most (memory), though never fewer than 4 blocks' worth


def whole_blocks(dataset: Any, max_length: int | None) -> Any:
    """``dataset`` (tokenized documents) cut into ``max_length`` blocks across map batches large enough that a
    short block ends one batch in every ``BLOCKS_A_BATCH`` blocks at most, or as it is where TRL's batches of
    1,000 documents already hold that many (and for streams, whose length is unknown)."""
    from ftcore_plugins.common.prepare import is_stream

    if dataset is None or not max_length or is_stream(dataset) or not len(dataset):
        return dataset
    import pyarrow.compute as pc

    tokens = pc.sum(pc.list_value_length(dataset.with_format("arrow")[:]["input_ids"])).as_py() or 0
    wanted = max(min(BLOCKS_A_BATCH * max_length, TOKENS_A_BATCH), 4 * max_length)
    rows = math.ceil(wanted * len(dataset) / max(tokens, 1))
    if rows <= 1000:
        return dataset
    from trl.data_utils import pack_dataset

    return pack_dataset(dataset.select_columns(["input_ids", "labels"]), max_length, "wrapped",
                        {"batch_size": rows, "desc": f"Cutting {max_length}-token blocks"})


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
        train, evaluation = tokenize_splits(ctx, max_length=None, batch_size=self.options.batch_size)
        # packing cuts the blocks; whole_blocks first where TRL's batches of documents would cut them short
        return whole_blocks(train, self.options.max_length), whole_blocks(evaluation, self.options.max_length)

    def trl_config(self, ctx: Any) -> dict[str, Any]:
        # "wrapped" packing: concatenate documents and cut max_length blocks, no padding.
        return {"packing": True, "packing_strategy": "wrapped"}


PretrainTrainer = Pretrain  # the name before Pretrain became public; kept for existing imports


@ftcore.hookimpl
def register_trainers(register):
    register(Pretrain)
