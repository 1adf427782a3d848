"""Packing rows with images (issue #31): ``packing = true`` on the families whose attention allows it.

What a packed batch must be is fixed by the unpacked one: the same model on the same rows gives the same
loss, whether the samples share one row (the CPU's per-sample SDPA, varlen flash attention) or a row per
bin (flex, SDPA with transformers' block mask). A packing that lets samples see each other, or that
restarts no positions, fails that. The lengths the bins are cut from are predicted without decoding an
image, and must be the processor's own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_cli
from test_vision_labels import FAMILIES, TOKENIZERS, built, native, png, rows
from test_vision_sft import losses, write_data, write_plan

pytestmark = pytest.mark.skipif(not TOKENIZERS.is_dir(), reason="../shared/fixtures/tokenizers is absent")

PACKED = ("llava", "idefics3", "qwen2_5_vl", "qwen3_vl")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Rows of every kind, as a dataset: one image, two images, two turns, a larger image (more tokens on
    the families that tile or resize), and text alone."""
    from datasets import Dataset
    from PIL import Image

    folder = tmp_path_factory.mktemp("packing")
    paths = []
    for color in ("red", "blue"):
        (folder / f"{color}.png").write_bytes(png(color))
        paths.append(str(folder / f"{color}.png"))
    Image.new("RGB", (70, 50), "green").save(folder / "large.png")
    found = list(rows(paths).values())
    found.append({"messages": [{"role": "user", "content": "<image>Is it large?"},
                               {"role": "assistant", "content": "Yes."}], "images": [str(folder / "large.png")]})
    found.append({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}],
                  "images": []})
    return Dataset.from_list([{**row, "__index": i} for i, row in enumerate(found)])


def encoder(family):
    from ftcore_plugins.common.vision import VisionEncoder

    return VisionEncoder(built(family)[1], native(), max_length=4096)


@pytest.mark.parametrize("family", PACKED)
def test_predicted_lengths_are_the_processors(family, corpus):
    """The lengths bins are cut from (each image's size read from its header, no pixels decoded) equal the
    lengths the processor gives the rows with their images expanded."""
    from ftcore_plugins.common.vision import VisionCollator
    from ftcore_plugins.trainers._vision import expanded_lengths

    batch = VisionCollator(encoder(family))([corpus[i] for i in range(len(corpus))])
    assert expanded_lengths(encoder(family), corpus) == batch["attention_mask"].sum(1).tolist()


@pytest.mark.parametrize("max_length", [4096, 30])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_data_report_counts_what_the_batches_hold(family, max_length, corpus):
    """What the stage's data report counts for each row (its tokens, images expanded, and the tokens it trains,
    once max_length has cut its end), predicted without decoding an image, is what the collator's batch of the
    row holds; at 30 tokens most rows are cut. Gemma 3's processor writes newlines around each image that can
    merge with the text beside it: there, a row with images may be off by two tokens per image. A row the
    collator refuses (max_length would cut into an image) is not compared."""
    from ftcore.errors import FtcoreError
    from ftcore_plugins.common.chat import IGNORE
    from ftcore_plugins.common.vision import VisionCollator, VisionEncoder
    from ftcore_plugins.trainers._vision import row_tokens

    encoder = VisionEncoder(built(family)[1], native(), max_length=max_length)
    predicted = row_tokens(encoder, corpus)
    compared = 0
    for row, got in zip(corpus, predicted):
        try:
            batch = VisionCollator(encoder)([row])
        except FtcoreError as exc:
            assert "would cut into an image" in str(exc)
            continue
        length, trained = int(batch["attention_mask"].sum()), int((batch["labels"] != IGNORE).sum())
        slack = 2 * got.images if family == "gemma3" else 0
        assert abs(min(got.length, max_length) - length) <= slack, (family, row["__index"], got, length)
        assert abs(got.trained - trained) <= slack, (family, row["__index"], got, trained)
        assert got.images == len(row["images"])
        compared += 1
    assert compared >= 3


@pytest.mark.parametrize("binned", [False, True], ids=["one-row", "row-per-bin"])
@pytest.mark.parametrize("family", PACKED)
def test_a_packed_batch_has_the_loss_of_the_unpacked_one(family, binned, corpus):
    import torch

    from ftcore_plugins.common.vision import VisionCollator
    from ftcore_plugins.trainers._packing import BinnedBatches, attention_for
    from ftcore_plugins.trainers._vision import BIN, PackedImageRows, rope_index

    model = built(family)[0].eval()
    reference = VisionCollator(encoder(family))([corpus[i] for i in range(len(corpus))])
    with torch.no_grad():
        unpacked = model(**reference, use_cache=False).loss.item()
    collator = PackedImageRows(encoder(family), corpus, rope_index(model))
    collator.binned = binned
    batch = collator([{BIN: [0, 3]}, {BIN: [1, 2, 4]}])
    assert batch.pop(BinnedBatches.REAL_TOKENS) == int(reference["attention_mask"].sum())
    assert "attention_mask" not in batch and batch["input_ids"].shape[0] == (2 if binned else 1)
    with attention_for(model, "sdpa_block" if binned else "sdpa_per_sample"), torch.no_grad():
        packed = model(**batch, use_cache=False).loss.item()
    assert abs(packed - unpacked) < 1e-5, (family, packed, unpacked)
    if family == "llava" and not binned:
        # The control: the same row without restarting positions (the samples see each other) is another loss.
        batch["position_ids"] = torch.arange(batch["input_ids"].shape[1])[None]
        with attention_for(model, "sdpa_per_sample"), torch.no_grad():
            assert abs(model(**batch, use_cache=False).loss.item() - unpacked) > 1e-3


def test_best_fit_packs_as_trls_bfd():
    """Every row in exactly one bin, no bin over capacity but a row longer than it, alone; as many bins as
    TRL's best-fit-decreasing packing makes of rows of the same lengths."""
    import random

    from datasets import Dataset
    from trl.data_utils import pack_dataset

    from ftcore_plugins.trainers._vision import best_fit

    lengths = [random.Random(1).randint(5, 300) for _ in range(500)] + [700]
    bins = best_fit(lengths, 512)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert [b for b in bins if sum(lengths[i] for i in b) > 512] == [[len(lengths) - 1]]
    trl = pack_dataset(Dataset.from_dict({"input_ids": [[0] * n for n in lengths[:-1]]}), 512, strategy="bfd")
    assert len(bins) - 1 == len(trl)


@pytest.mark.slow
def test_sft_plan_with_packing_on_image_rows(tmp_path):
    """`ftcore run` with packing = true on a LLaVA plan: the rows go into fewer, fuller rows, the stage counts
    the real tokens it trained (24 rows of 27 tokens, 6 steps of every row), and the loss and eval loss fall."""
    write_data(tmp_path, n=24)
    plan = write_plan(tmp_path, "llava", 'packing = true\neval_data = "train"\neval_steps = 3\n')
    done = run_cli("run", str(plan), cwd=tmp_path, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "runs" / "plan"
    seen = losses(run)
    assert seen[-1] < seen[0] - 0.05, seen
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]  # eval rows: each its own sample, packed too
    assert len(evals) >= 2 and evals[-1] < evals[0], evals
    first = {k: v for r in records for k, v in r.items()}
    assert first["packed_attention"] == "sdpa_per_sample"
    assert 0 < first["data/train_packed_sequences"] < 24 and first["data/train_packing_efficiency"] > 0.5
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stages"]["sft"]["train_tokens"] == 6 * 24 * 27
    assert Path(run / "stages" / "sft" / "output" / "processor_config.json").is_file()
