"""Pretraining's blocks at long max_length (issue #43): TRL cuts its "wrapped" blocks inside map batches of
1,000 documents, so with short documents and long rows every row fell short of max_length. The pretrain trainer
cuts them across larger batches first; what TRL's SFTTrainer then does to them (its own wrapped packing) keeps
them whole."""

from __future__ import annotations

import random

import pytest


def documents(n: int, seed: int = 0):
    """Tokenized documents as ftcore's prepare leaves them for pretraining: labels are the inputs."""
    from datasets import Dataset

    rng = random.Random(seed)
    ids = [[rng.randrange(3, 500) for _ in range(rng.randint(5, 60))] for _ in range(n)]
    return Dataset.from_dict({"input_ids": ids, "labels": [list(x) for x in ids]})


def trl_packs(dataset, max_length):
    """What SFTTrainer does to a pretrain stage's rows (``packing_strategy = "wrapped"``, its map defaults)."""
    from trl.data_utils import pack_dataset

    return pack_dataset(dataset.select_columns(["input_ids", "labels"]), max_length, "wrapped", {})


def lengths(dataset):
    return [len(x) for x in dataset["input_ids"]]


def test_long_rows_are_whole_but_the_last():
    from ftcore_plugins.trainers.pretrain import whole_blocks

    docs = documents(3000)
    tokens = sum(lengths(docs))
    length = 8192  # 3,000 documents of about 32 tokens: 1,000 of them hold about 4 such rows
    alone = lengths(trl_packs(docs, length))
    assert sum(1 for n in alone if n < length) == 3  # what TRL alone gives: a short row ends each batch
    rows = trl_packs(whole_blocks(docs, length), length)
    cut = lengths(rows)
    assert cut[:-1] == [length] * (len(cut) - 1) and 0 < cut[-1] <= length and sum(cut) == tokens
    # the same tokens in the same order, and labels still equal to the inputs
    flat = [t for row in rows["input_ids"] for t in row]
    assert flat == [t for doc in docs["input_ids"] for t in doc]
    assert rows["labels"] == rows["input_ids"]


@pytest.mark.parametrize("length", [128, 1024])
def test_short_rows_are_left_to_trl(length):
    """Where 1,000 documents hold 64 blocks or more (the quickstart's 128-token rows), nothing changes."""
    from ftcore_plugins.trainers.pretrain import whole_blocks

    docs = documents(3000, seed=1)
    out = whole_blocks(docs, length)
    if length == 128:
        assert out is docs
    else:  # 1,000 documents hold about 32 blocks of 1,024: cut over 2,000 documents a batch
        assert sum(1 for n in lengths(trl_packs(out, length)) if n < length) == 1
