"""Reasoning models on the real Qwen3 tokenizer and its own (thinking-aware, not prefix-stable) template.

Qwen3 drops <think> blocks from assistant turns before the last user message. With [template] use = "native"
a multi-turn conversation trains as the template renders it (history without reasoning, the last turn with
it); ``samples = "per_turn"`` makes one sample per assistant turn, each with its own reasoning; and
``chat_template_kwargs = {enable_thinking = false}`` trains the no-think mode, where the empty think
block belongs to the prompt.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ftcore.testing import write_jsonl

QWEN3 = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "tokenizers" / "qwen3"
pytestmark = pytest.mark.skipif(not QWEN3.is_dir(), reason="../shared/fixtures/tokenizers/qwen3 is absent")

TOPICS = ["cats", "rivers", "stars", "bread", "maps", "owls", "rain", "salt"]


def conversation(k: int) -> list[dict]:
    a, b = TOPICS[k % len(TOPICS)], TOPICS[(k + 3) % len(TOPICS)]
    return [{"role": "user", "content": f"Tell me about {a}."},
            {"role": "assistant", "content": f"<think>\nThe user asks about {a}.\n</think>\n\n{a.title()} are nice."},
            {"role": "user", "content": f"And {b}?"},
            {"role": "assistant", "content": f"<think>\nNow {b}.\n</think>\n\n{b.title()} are fine too."}]


def labelled(tokenizer, template, rows) -> list[list[str]]:
    """For each sample: the decoded runs of consecutive labelled tokens."""
    import datasets

    from ftcore_plugins.common.chat import IGNORE, encode

    cols, _ = encode(datasets.Dataset.from_list(rows), tokenizer, template, max_length=None)
    out = []
    for ids, labels in zip(cols["input_ids"], cols["labels"]):
        runs, current = [], []
        for token, label in zip(ids, labels):
            if label != IGNORE:
                assert label == token
                current.append(token)
            elif current:
                runs.append(tokenizer.decode(current))
                current = []
        if current:
            runs.append(tokenizer.decode(current))
        out.append(runs)
    return out


@pytest.fixture(scope="module")
def qwen3():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(QWEN3)


def native(**options):
    from ftcore_plugins.templates.native import NativeTemplate

    return NativeTemplate(NativeTemplate.Options(**options))


def test_native_trains_history_without_reasoning_and_the_last_turn_with_it(qwen3):
    [runs] = labelled(qwen3, native(), [{"messages": conversation(0)}])
    assert runs == ["Cats are nice.<|im_end|>", "<think>\nNow bread.\n</think>\n\nBread are fine too.<|im_end|>"]


def test_per_turn_samples_train_each_turns_reasoning_in_its_own_context(qwen3):
    first, second = labelled(qwen3, native(samples="per_turn"), [{"messages": conversation(0)}])
    assert first == ["<think>\nThe user asks about cats.\n</think>\n\nCats are nice.<|im_end|>"]
    assert second == ["<think>\nNow bread.\n</think>\n\nBread are fine too.<|im_end|>"]


def test_no_think_mode_puts_the_empty_think_block_in_the_prompt(qwen3):
    rows = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}]
    [thinking] = labelled(qwen3, native(), rows)
    [no_think] = labelled(qwen3, native(chat_template_kwargs={"enable_thinking": False}), rows)
    # Thinking mode: the model writes the (empty) think block itself; no-think: the prompt holds it.
    assert thinking == ["<think>\n\n</think>\n\nHello.<|im_end|>"]
    assert no_think == ["Hello.<|im_end|>"]
    prompt = native(chat_template_kwargs={"enable_thinking": False}).render(rows[0]["messages"][:1], qwen3,
                                                                             add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def real_tokenizer_plan(ftcore_plan, tokenizer: Path, template: dict, data: str, **stage) -> Path:
    """The testing kit's tiny plan (a 2-layer, hidden-64 Llama from scratch) on a real tokenizer, with
    ``template`` as [template] and ``data`` (a JSONL file next to the plan) trained by one short sft stage."""
    return ftcore_plan({
        "model": {"tokenizer": tokenizer.as_posix(), "tokenizer_data": None, "vocab_size": None,
                  "max_position_embeddings": 2048},
        "data": {"chat": {"path": data}, "chat_eval": None, "text": None},
        "stage": [{"name": "sft", "trainer": "sft", "data": "chat", "adapter": "full", "batch_size": 8,
                   "max_length": 128, "learning_rate": 3e-3, "logging_steps": 1, "save_steps": 100, **stage}],
        "template": template}, data=False)


@pytest.mark.slow
def test_a_multi_turn_sft_run_with_native_on_qwen3_trains(ftcore_plan, ftcore_run):
    tmp_path = ftcore_plan.dir
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": conversation(k)} for k in range(48)])
    plan = real_tokenizer_plan(ftcore_plan, QWEN3, {"use": "native", "samples": "per_turn"}, "chat.jsonl",
                               max_steps=12)
    run = ftcore_run("run", plan, cwd=tmp_path).check()
    losses = run.losses("sft")
    assert len(losses) == 12
    assert losses[12] < losses[1] - 1.5, losses  # it learns (from 12.0, the log of Qwen3's 151k-token vocabulary)
    stats = json.loads((run.run_dir / "data_report.json").read_text())
    tokenized = [v for v in _dicts(stats) if "samples" in v and "kept" in v]
    assert tokenized and tokenized[0]["rows"] == 48 and tokenized[0]["samples"] == 96  # one sample per turn


def _dicts(value):
    if isinstance(value, dict):
        yield value
        for v in value.values():
            yield from _dicts(v)
    elif isinstance(value, list):
        for v in value:
            yield from _dicts(v)
