"""Streaming sources (``streaming = true``): rows read, converted and tokenized as training reads
them, the same tokens and labels as the prepared path, refused where a stream cannot serve, and a
run that trains from one."""

from __future__ import annotations

import json

import pytest

from conftest import SHARED, run_cli, write_jsonl
from test_sources import load_data

from ftcore.errors import FtcoreError

FIXTURES = ("alpaca_en_demo.json", "glaive_toolcall_en_demo.json") if (SHARED / "data").exists() else ()


def tokenizer():
    folder = SHARED / "tokenizers" / "qwen25"
    if not folder.exists():
        pytest.skip("../shared/fixtures/tokenizers/qwen25 not present")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def without_none(value):
    if isinstance(value, dict):
        return {k: without_none(v) for k, v in value.items() if v is not None}
    return [without_none(v) for v in value] if isinstance(value, list) else value


@pytest.mark.parametrize("fixture", FIXTURES or [pytest.param("absent", marks=pytest.mark.skip("no fixtures"))])
def test_streamed_rows_tokenize_to_what_the_prepared_rows_give(tmp_path, fixture):
    """Real Alpaca and ShareGPT (glaive, with tools) files: every row converts, and tokenizes (ids and assistant-only
    labels, max_length applied) exactly as the prepared, cached path does."""
    from ftcore_plugins.common.prepare import prepare, stream_tokenized
    from ftcore_plugins.templates.chatml import ChatMLTemplate
    from ftcore_plugins.templates.native import NativeTemplate

    # Qwen2.5's own template renders the glaive rows' tool schemas; chatml has no place for them.
    tok, template = tokenizer(), NativeTemplate() if "toolcall" in fixture else ChatMLTemplate()
    section = f'use = "json"\npath = "{SHARED / "data" / fixture}"\n'
    whole = load_data(tmp_path, section).ds
    streamed = load_data(tmp_path, section + "streaming = true\n")
    assert "streaming chat rows" in streamed.output and streamed.stats["streaming"]
    # The prepared path prunes the columns and message keys no row uses; a stream cannot know that
    # ahead, so they are None there, which the templates read as absent.
    assert [without_none(r) for r in streamed.ds] == [without_none(r) for r in whole]
    prepared = prepare(whole, tok, template, max_length=256, use_cache=False).dataset
    tokenized = list(stream_tokenized(streamed.ds, tok, template, max_length=256))
    assert len(tokenized) == len(prepared) > 100
    assert [r["input_ids"] for r in tokenized] == prepared["input_ids"]
    assert [r["labels"] for r in tokenized] == prepared["labels"]
    assert any(-100 in r["labels"] for r in tokenized)  # prompts masked: the labels are not the ids


def test_a_bad_row_in_a_stream_names_its_row_or_is_skipped(tmp_path):
    rows = [{"text": f"row {i}"} for i in range(30)]
    rows[17] = {"text": 5}
    write_jsonl(tmp_path / "t.jsonl", rows)
    streamed = load_data(tmp_path, 'use = "jsonl"\npath = "t.jsonl"\nstreaming = true\n').ds
    with pytest.raises(FtcoreError, match=r"data.train: t.jsonl: row 18: .*on_error = \"skip\""):
        list(streamed)
    skipped = load_data(tmp_path, 'use = "jsonl"\npath = "t.jsonl"\nstreaming = true\non_error = "skip"\n'
                        'limit = 25\nmin_chars = 6\n').ds
    # the first 25 rows read (limit: skipped and filtered rows count, as for a source read whole): row 17 skipped
    # (bad), rows 0-9 dropped by min_chars ("row 0" has 5 characters)
    assert [r["text"] for r in skipped] == [f"row {i}" for i in range(10, 25) if i != 17]


@pytest.mark.parametrize("extra, stage, message", [
    ("", "", "stage[0].max_steps: stage 'pre' trains on data.text, which streams and so has no length to count "
             "epochs by; set max_steps"),
    ('dedup = "exact"\n', "max_steps = 2\n", "data.text.dedup: needs the whole data at once"),
    ("validation = 0.1\n", "max_steps = 2\n", "data.text.validation: a streaming source has no held-out split"),
    ("", 'max_steps = 2\neval_data = "stream"\n', "data.text.streaming: only a stage's training data can stream; "
                                                "stage 'pre' eval_data reads it whole"),
])
def test_streaming_is_refused_where_it_cannot_serve(tiny_project, extra, stage, message):
    plan = tiny_project(f"""
[data.stream]
use = "jsonl"
path = "text.jsonl"
streaming = true
{extra}
[[stage]]
name = "pre"
trainer = "pretrain"
data = "stream"
{stage}""".replace("data.text", "data.stream"))
    r = run_cli("validate", str(plan))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert message.replace("data.text", "data.stream") in r.stderr, r.stderr


def test_a_trainer_that_cannot_stream_says_so(tiny_project):
    plan = tiny_project("""
[data.pairs]
use = "jsonl"
path = "chat.jsonl"
streaming = true

[[stage]]
trainer = "dpo"
data = "pairs"
max_steps = 2
""")
    r = run_cli("validate", str(plan))
    assert r.returncode == 2
    assert "trainer 'dpo' cannot train from a stream; set streaming = false there" in r.stderr


@pytest.mark.slow
def test_streaming_pretrain_and_packed_sft_train(tiny_project):
    """Pretrain (wrapped blocks) and packed SFT from streams: the loss falls, every block is full,
    and `ftcore prepare` leaves streams alone."""
    write_jsonl(tiny_project.dir / "more_text.jsonl",
                [{"text": " ".join(f"the {w} runs over the {w} hill" for w in ("cat", "dog", "fox")[: 1 + i % 3])}
                 for i in range(400)])
    plan = tiny_project("""
[data.corpus]
use = "jsonl"
path = "more_text.jsonl"
streaming = true

[data.chat_stream]
use = "jsonl"
path = "chat.jsonl"
streaming = true

[[stage]]
name = "pre"
trainer = "pretrain"
data = "corpus"
max_length = 32
max_steps = 30
batch_size = 4
learning_rate = 3e-3
logging_steps = 1

[[stage]]
name = "sft"
trainer = "sft"
adapter = "lora"
data = "chat_stream"
packing = true
max_length = 64
max_steps = 3
batch_size = 2
logging_steps = 1
""")
    prepared = run_cli("prepare", str(plan))
    assert prepared.returncode == 0, prepared.stderr[-2000:]
    assert "stage pre: data 'corpus' streams as the stage trains: nothing to prepare" in prepared.stdout
    r = run_cli("run", str(plan))
    assert r.returncode == 0, r.stderr[-3000:]
    run = tiny_project.dir / "runs" / "tiny"
    logs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in logs if m.get("stage") == "pre" and "loss" in m]
    assert len(losses) == 30 and sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stages"]["pre"]["train_tokens"] == 30 * 4 * 32  # wrapped blocks: no padding
    assert summary["stages"]["sft"]["global_step"] == 3
