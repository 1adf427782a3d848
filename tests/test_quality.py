"""Dedup, filters, splits and mixing: each counts what it did, and splits never leak."""

from __future__ import annotations

import base64
import json

import pytest

from conftest import chat_rows, run_cli, write_jsonl

datasets = pytest.importorskip("datasets")


def options(**kw):
    from ftcore_plugins.data._quality import QualityOptions

    return QualityOptions(**kw)


def run(rows, **kw):
    from ftcore_plugins.data._quality import clean_and_split

    stats: dict = {}
    out = clean_and_split(datasets.Dataset.from_list(rows), options(**kw), stats, "data.test")
    return out, stats


def text(t):
    return {"text": t}


LONG = ("the quick brown fox jumps over the lazy dog while the farmer watches from the old red barn "
        "and the children play by the river under the tall green trees in the warm afternoon sun")


def test_exact_dedup_ignores_case_and_whitespace_but_not_words():
    rows = [text("Hello  World"), text("hello world"), text("hello world!"), text("HELLO\nWORLD")]
    out, stats = run(rows, dedup="exact")
    assert out["train"]["text"] == ["Hello  World", "hello world!"]
    assert stats["dropped_duplicate"] == 2
    out, stats = run(rows)  # the default keeps them, and counts them
    assert len(out["train"]) == 4 and "dropped_duplicate" not in stats and stats["duplicates_kept"] == 2


def test_near_dedup_drops_a_one_word_edit_and_keeps_different_texts():
    edited = LONG.replace("lazy", "sleepy")
    different = "a completely different sentence about cooking pasta with tomatoes garlic and basil " * 2
    out, stats = run([text(LONG), text(edited), text(different)], dedup="near")
    assert out["train"]["text"] == [LONG, different]
    assert stats["dropped_near_duplicate"] == 1
    out, _ = run([text(LONG), text(edited), text(different)], dedup="exact")
    assert len(out["train"]) == 3


def test_near_dedup_counts_exact_repeats_apart_from_near_duplicates():
    """Near dedup sees every row that passes the filters: an exact repeat (case and spacing aside) is
    dropped and counted as a duplicate, a one-word edit as a near-duplicate; the first of each stays."""
    edited = LONG.replace("lazy", "sleepy")
    different = "a completely different sentence about cooking pasta with tomatoes garlic and basil " * 2
    rows = [text(LONG), text(LONG.upper()), text(edited), text(different), text(LONG), text(edited)]
    out, stats = run(rows, dedup="near")
    assert out["train"]["text"] == [LONG, different]
    assert stats["dropped_duplicate"] == 3 and stats["dropped_near_duplicate"] == 1 and stats["rows_kept"] == 2


def test_filters_count_each_reason():
    rows = [text(""), text("   "), text("hi"), text("fine text here"), text("x" * 500),
            text("binary \x00\x01 junk"), text(base64.b64encode(bytes(range(200))).decode()), text("def f(x): return x * 2  # code is text")]
    out, stats = run(rows, min_chars=3, max_chars=300)
    assert out["train"]["text"] == ["fine text here", "def f(x): return x * 2  # code is text"]
    assert (stats["dropped_empty"], stats["dropped_too_short"], stats["dropped_too_long"],
            stats["dropped_non_text"]) == (2, 1, 1, 2)


def test_random_split_is_seeded_and_sized():
    rows = [text(f"row {i}") for i in range(100)]
    a, stats = run(rows, validation=0.2, seed=1)
    b, _ = run(rows, validation=0.2, seed=1)
    c, _ = run(rows, validation=20, seed=2)
    assert len(a["validation"]) == 20 and len(a["train"]) == 80 and stats["validation_rows"] == 20
    assert a["validation"]["text"] == b["validation"]["text"] != c["validation"]["text"]
    assert not set(a["train"]["text"]) & set(a["validation"]["text"])


def test_stratified_split_keeps_each_class_share():
    rows = [{"text": f"row {i}", "topic": "rare" if i % 10 == 0 else "common"} for i in range(200)]
    out, _ = run(rows, validation=0.25, split_strategy="stratified", split_by="topic")
    topics = out["validation"]["topic"]
    assert topics.count("rare") == 5 and topics.count("common") == 45


def test_grouped_split_never_puts_a_group_on_both_sides():
    rows = [{"text": f"conversation {g} turn {t}", "conversation_id": g} for g in range(30) for t in range(4)]
    out, _ = run(rows, validation=0.2, split_strategy="grouped", split_by="conversation_id")
    train, val = set(out["train"]["conversation_id"]), set(out["validation"]["conversation_id"])
    assert val and train and not train & val
    assert len(out["validation"]) % 4 == 0


def test_dedup_runs_before_the_split_so_duplicates_cannot_straddle_it():
    rows = [text(f"row {i % 50}") for i in range(100)]  # every row twice
    out, stats = run(rows, validation=0.5, seed=3, dedup="exact")
    assert stats["dropped_duplicate"] == 50
    assert not set(out["train"]["text"]) & set(out["validation"]["text"])


def test_split_options_are_checked():
    with pytest.raises(ValueError, match="split_by"):
        options(split_strategy="grouped")
    with pytest.raises(ValueError, match="between 0 and 1"):
        options(validation=1.5)


def test_mix_by_weight_through_a_plan(tiny_project):
    write_jsonl(tiny_project.dir / "replay.jsonl", chat_rows(200, seed=5))
    plan = tiny_project("""
[data.replay]
use = "jsonl"
path = "replay.jsonl"

[data.mixed]
use = "mix"
sources = { chat = 0.7, replay = 0.3 }
rows = 80

[[stage]]
trainer = "sft"
data = "mixed"
adapter = "full"
max_steps = 1
""")
    assert run_cli("validate", str(plan)).returncode == 0
    result = run_cli("run", str(plan))
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((tiny_project.dir / "runs" / "tiny" / "data_report.json").read_text())
    mixed = report["source/mixed"]
    assert (mixed["rows"], mixed["rows_from_chat"], mixed["rows_from_replay"]) == (80, 56, 24)
    assert mixed["repeated_rows"] == 0  # chat has 64 rows, 56 are drawn without repeats
    assert report["0-sft/train"]["rows"] == 80


def test_mix_errors_are_caught_by_validate(tiny_project):
    plan = tiny_project("""
[data.mixed]
use = "mix"
sources = { chat = 0.5, nowhere = 0.5 }

[[stage]]
trainer = "sft"
data = "mixed"
""")
    result = run_cli("validate", str(plan))
    assert result.returncode == 2 and "data.mixed.sources: undefined data 'nowhere'" in result.stderr


def test_validation_split_is_referenced_as_name_colon_validation(tiny_project):
    plan = tiny_project("""
[data.all]
use = "jsonl"
path = "chat.jsonl"
validation = 16
dedup = "exact"

[[stage]]
trainer = "sft"
data = "all"
eval_data = "all:validation"
adapter = "full"
max_steps = 2

[[evaluate]]
use = "perplexity"
data = "all:validation"
""")
    assert run_cli("validate", str(plan)).returncode == 0
    result = run_cli("run", str(plan))
    assert result.returncode == 0, result.stderr[-2000:]
    run = tiny_project.dir / "runs" / "tiny"
    report = json.loads((run / "data_report.json").read_text())
    source = report["source/all"]
    assert source["validation_rows"] == 16
    assert source["train_rows"] + 16 == source["rows_kept"] == 64 - source.get("dropped_duplicate", 0)
    assert report["0-sft/train"]["rows"] == source["train_rows"] and report["0-sft/eval"]["rows"] == 16
    assert json.loads((run / "summary.json").read_text())["evaluations"]["after"]["perplexity"]["tokens"] > 0


def test_a_split_that_is_not_held_out_is_a_plan_error(tiny_project):
    plan = tiny_project("""
[[stage]]
trainer = "sft"
data = "chat"
eval_data = "chat:validation"
""")
    result = run_cli("validate", str(plan))
    assert result.returncode == 2
    assert "stage[0].eval_data: data 'chat' has no split 'validation'; it has: train" in result.stderr
    assert "validation = 0.1" in result.stderr


def test_sft_on_preference_pairs_trains_on_prompt_and_chosen(tiny_project):
    rows = [{"prompt": [{"role": "user", "content": "Which is an animal? red fox tree"}],
             "chosen": [{"role": "assistant", "content": "the fox"}],
             "rejected": [{"role": "assistant", "content": "the tree"}]}] * 8
    write_jsonl(tiny_project.dir / "pairs.jsonl", rows)
    plan = tiny_project("""
[data.pairs]
use = "jsonl"
path = "pairs.jsonl"

[[stage]]
trainer = "sft"
data = "pairs"
adapter = "full"
max_steps = 1
""")
    result = run_cli("run", str(plan))
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((tiny_project.dir / "runs" / "tiny" / "data_report.json").read_text())
    assert report["0-sft/train"]["kept"] == 8 and report["0-sft/train"]["label_tokens"] > 0


def test_near_dedup_says_when_its_index_may_not_fit(monkeypatch):
    """The index grows by NearDuplicates.BYTES_PER_ROW a row (benchmarks/dedup_memory.py measured it):
    when that would take over half the memory available, one warning says so, with the numbers."""
    from ftcore_plugins.common import memory
    from ftcore_plugins.data._quality import NearDuplicates, clean_and_split

    rows = [text(f"{LONG} {i}") for i in range(40)]
    warned: list[str] = []
    monkeypatch.setattr(memory, "available_bytes", lambda: 40 * NearDuplicates.BYTES_PER_ROW)  # room for 20 rows
    out = clean_and_split(datasets.Dataset.from_list(rows), options(dedup="near"), {}, "data.big", warn=warned.append)
    assert len(warned) == 1 and warned[0].startswith("data.big: near dedup of 40 rows holds about")
    assert "dedup = \"exact\"" in warned[0]
    assert len(out["train"]) == 1  # the rows are near-duplicates of the first: dedup still ran
    monkeypatch.setattr(memory, "available_bytes", lambda: 100 * NearDuplicates.BYTES_PER_ROW)
    warned.clear()
    clean_and_split(datasets.Dataset.from_list(rows), options(dedup="near"), {}, "data.big", warn=warned.append)
    assert warned == []
