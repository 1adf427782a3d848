"""Tokenized data: the cache hits and misses on exactly what matters, length limits
follow the chosen strategy, and packing changes no sample's loss."""

from __future__ import annotations

import pytest

from conftest import SHARED, chat_rows, run_cli

torch = pytest.importorskip("torch")
datasets = pytest.importorskip("datasets")

LONG = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Tell me about the sea. " * 6},
        {"role": "assistant", "content": "It is large and blue and deep. " * 4}]


def qwen():
    folder = SHARED / "tokenizers" / "qwen25"
    if not folder.exists():
        pytest.skip("../shared/fixtures/tokenizers/qwen25 not present")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def chatml():
    from ftcore_plugins.templates.chatml import ChatMLTemplate

    return ChatMLTemplate()


def prep(rows, tok, template, **kw):
    from ftcore_plugins.common.prepare import prepare

    kw.setdefault("max_length", 256)
    return prepare(datasets.Dataset.from_list(rows), tok, template, **kw)


def test_cache_hits_for_the_same_inputs_and_misses_when_any_part_of_the_key_changes(monkeypatch):
    import ftcore_plugins.common.prepare as prepare_module
    from ftcore_plugins.templates.native import NativeTemplate

    tok, template, rows = qwen(), chatml(), chat_rows(40)
    first = prep(rows, tok, template)
    again = prep(rows, tok, template)
    assert not first.cache_hit and again.cache_hit and again.key == first.key
    assert again.dataset["input_ids"] == first.dataset["input_ids"]
    assert again.dataset["labels"] == first.dataset["labels"]
    assert again.stats == first.stats

    changed_row = [dict(r) for r in rows]
    changed_row[7] = chat_rows(1, seed=99)[0]
    keys = {"data": prep(changed_row, tok, template).key,
            "template": prep(rows, tok, NativeTemplate()).key,  # qwen's own template adds a system prompt
            "max_length": prep(rows, tok, template, max_length=255).key,
            "truncation": prep(rows, tok, template, truncation="drop").key,
            "train_on_inputs": prep(rows, tok, template, train_on_inputs=True).key}
    tok2 = qwen()
    tok2.add_special_tokens({"additional_special_tokens": ["<|new|>"]})
    keys["tokenizer special tokens"] = prep(rows, tok2, template).key
    tok3 = qwen()
    tok3.chat_template = "{{ messages }}"
    keys["tokenizer chat template"] = prep(rows, tok3, template).key
    monkeypatch.setattr(prepare_module, "DATA_LAYER_VERSION", prepare_module.DATA_LAYER_VERSION + 1)
    keys["data-layer version"] = prep(rows, tok, template).key
    for what, key in keys.items():
        assert key != first.key, f"changing the {what} did not change the cache key"
    assert len(set(keys.values())) == len(keys)


def test_shards_give_the_data_one_pass_gives_and_resume_after_a_kill(monkeypatch):
    """Preparation streams into shards of SHARD_ROWS rows: the same samples, labels and stats as
    one in-memory pass; a preparation that dies in its third shard resumes there, encoding only
    the shards it had not finished, and a row's error names its place in the whole data."""
    import ftcore_plugins.common.prepare as prepare_module
    from ftcore_plugins.common.cache import cache_dir

    tok, template = qwen(), chatml()
    rows = chat_rows(35) + [{"messages": LONG}]
    whole = prep(rows, tok, template, max_length=64, use_cache=False)
    monkeypatch.setattr(prepare_module, "SHARD_ROWS", 10)
    encoded, real_encode = [], prepare_module.encode

    def dies_in_the_third_shard(part, **kw):
        encoded.append(kw["first_row"])
        if kw["first_row"] == 20 and len(encoded) == 3:
            raise KeyboardInterrupt  # as a kill would stop it: no cleanup of the finished shards
        return real_encode(part, **kw)

    monkeypatch.setattr(prepare_module, "encode", dies_in_the_third_shard)
    with pytest.raises(KeyboardInterrupt):
        prep(rows, tok, template, max_length=64)
    partial = list((cache_dir() / "tokenized").glob("*/.*.partial"))
    assert len(partial) == 1 and sorted(p.name for p in partial[0].glob("*.arrow")) == ["00000.arrow", "00001.arrow"]
    resumed = prep(rows, tok, template, max_length=64)
    assert encoded == [0, 10, 20, 20, 30]  # the finished shards 0 and 10 were not encoded again
    assert not resumed.cache_hit and not list((cache_dir() / "tokenized").glob("*/.*.partial"))
    assert resumed.dataset["input_ids"] == whole.dataset["input_ids"]
    assert resumed.dataset["labels"] == whole.dataset["labels"]
    assert resumed.stats == whole.stats and resumed.stats["rows"] == 36 and resumed.stats["truncated"] == 1
    again = prep(rows, tok, template, max_length=64)
    assert again.cache_hit and again.dataset["input_ids"] == whole.dataset["input_ids"] and again.stats == whole.stats
    assert len(again.dataset.cache_files) == 4  # memory-mapped shards, not a copy in memory
    again.dataset.map(lambda row: {"n": len(row["input_ids"])})  # as TRL maps it: datasets caches beside the shards
    assert prep(rows, tok, template, max_length=64).dataset["input_ids"] == whole.dataset["input_ids"]

    from ftcore.errors import FtcoreError

    marked = [{"role": "user", "content": "a private-use character \U000F0001"}, {"role": "assistant", "content": "no"}]
    broken = rows[:27] + [{"messages": marked}] + rows[27:]  # row 28, in the third shard

    with pytest.raises(FtcoreError, match=r"row 28: "):
        prep(broken, tok, template, max_length=64, where="data.chat (chat.jsonl)")


def test_a_template_whose_code_renders_differently_misses(monkeypatch):
    from ftcore_plugins.templates.chatml import ChatMLTemplate

    tok, rows = qwen(), chat_rows(5)
    before = prep(rows, tok, ChatMLTemplate()).key
    original = ChatMLTemplate.render
    monkeypatch.setattr(ChatMLTemplate, "render", lambda self, m, t=None, add_generation_prompt=False:
                        original(self, m, t, add_generation_prompt).replace("\n", "\n\n"))
    assert prep(rows, tok, ChatMLTemplate()).key != before


def test_cache_command_reports_and_clears(tmp_path):
    env = {"FTCORE_CACHE_DIR": str(tmp_path / "cache")}
    (tmp_path / "cache" / "tokenized" / "ab" / "abc").mkdir(parents=True)
    (tmp_path / "cache" / "tokenized" / "ab" / "abc" / "stats.json").write_text("{}")
    info = run_cli("cache", env=env)
    assert info.returncode == 0 and "1 files" in info.stdout
    cleared = run_cli("cache", "clear", env=env)
    assert cleared.returncode == 0 and not (tmp_path / "cache" / "tokenized").exists()


@pytest.mark.parametrize("truncation", ["truncate_response", "truncate_prompt", "drop"])
def test_length_strategies(truncation):
    tok, template = qwen(), chatml()
    full = prep([{"messages": LONG}], tok, template, max_length=None, use_cache=False)
    ids, labels = full.dataset["input_ids"][0], full.dataset["labels"][0]
    limit = len(ids) - 20
    got = prep([{"messages": LONG}], tok, template, max_length=limit, truncation=truncation, use_cache=False)
    if truncation == "drop":
        assert len(got.dataset) == 0 and got.stats["dropped_too_long"] == 1
        return
    assert got.stats["truncated"] == 1
    if truncation == "truncate_response":  # keeps the start: the prompt whole, the answer cut short
        assert got.dataset["input_ids"][0] == ids[:limit] and got.dataset["labels"][0] == labels[:limit]
    else:  # drops the oldest prompt tokens: the answer and its <|im_end|> survive
        assert got.dataset["input_ids"][0] == ids[-limit:] and got.dataset["labels"][0] == labels[-limit:]
        trained = [t for t in got.dataset["labels"][0] if t != -100]
        assert tok.convert_ids_to_tokens(trained[-1]) == "<|im_end|>"


def test_a_sample_with_nothing_left_to_learn_is_dropped_and_counted():
    tok, template = qwen(), chatml()
    got = prep([{"messages": LONG}, *chat_rows(3)], tok, template, max_length=20, use_cache=False)
    assert got.stats["dropped_no_labels"] == 1 and got.stats["kept"] == 3


def tiny_llama(vocab: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", vocab_size=vocab, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                  max_position_embeddings=256)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def per_token_nll(logits, labels):
    shift = torch.nn.functional.cross_entropy(logits[0, :-1].float(), labels[0, 1:], ignore_index=-100,
                                              reduction="none")
    return torch.cat([torch.zeros(1), shift])  # aligned with the label positions


def test_packing_gives_each_sample_the_loss_it_has_alone():
    """Best-fit packing through TRL (pack_dataset + its padding-free collator): per-sample
    losses equal the unpacked ones within 1e-5 in fp32. Plain concatenation does not."""
    from trl.data_utils import pack_dataset
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    import random

    rng = random.Random(0)
    samples = []
    for _ in range(12):
        n = rng.randint(5, 40)
        ids = [rng.randrange(3, 100) for _ in range(n)]
        cut = rng.randint(1, n - 2)
        samples.append({"input_ids": ids, "labels": [-100] * cut + ids[cut:]})
    model = tiny_llama(100)

    alone = []
    with torch.no_grad():
        for s in samples:
            logits = model(input_ids=torch.tensor([s["input_ids"]])).logits
            alone.append(per_token_nll(logits, torch.tensor([s["labels"]])).sum().item())

    packed = pack_dataset(datasets.Dataset.from_list(samples), 64, strategy="bfd")
    assert len(packed) < len(samples)
    collate = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    packed_losses = {}
    naive_losses = {}
    with torch.no_grad():
        for row in packed:
            batch = collate([row])
            assert "attention_mask" not in batch  # the mask comes from the position ids
            # use_cache=False as TRL's SFTTrainer.compute_loss passes: with a KV cache transformers
            # skips the packed-sequence mask it builds from the position ids.
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
            naive = model(input_ids=batch["input_ids"]).logits  # concatenated, attending across samples
            start = 0
            for length in row["seq_lengths"]:
                ids = tuple(row["input_ids"][start:start + length])
                labels = torch.tensor([row["labels"][start:start + length]])
                packed_losses[ids] = per_token_nll(logits[:, start:start + length], labels).sum().item()
                naive_losses[ids] = per_token_nll(naive[:, start:start + length], labels).sum().item()
                start += length
    worst = max(abs(packed_losses[tuple(s["input_ids"])] - a) / max(abs(a), 1e-6) for s, a in zip(samples, alone))
    assert worst < 1e-5, worst
    naive_worst = max(abs(naive_losses[tuple(s["input_ids"])] - a) / max(abs(a), 1e-6)
                      for s, a in zip(samples, alone))
    assert naive_worst > 1e-3  # the check would catch cross-sample attention


def test_padding_numbers_match_an_independent_count():
    from ftcore_plugins.common.prepare import packing_report, padding_fraction

    lengths = [10, 30, 20, 20, 5]
    # batches of 2 in this order: (10, 30) -> 60 slots, (20, 20) -> 40, (5) -> 5: 20 + 0 + 0 pads of 105
    assert padding_fraction(lengths, 2) == pytest.approx(20 / 105)
    data = datasets.Dataset.from_list([{"input_ids": list(range(n))} for n in lengths])
    report = packing_report(data, 40, 2)
    # best fit into 40-token bins: 85 tokens need at least 3 bins
    assert report["packed_sequences"] == 3
    assert report["packing_efficiency"] == pytest.approx(85 / 120)
    assert report["padding_fraction_packed"] == pytest.approx(35 / 120)


def test_real_sharegpt_tool_calls_become_trained_assistant_turns(tmp_path):
    """glaive (ShareGPT with function calls) through the json source, the qwen2.5
    template and the real Qwen tokenizer: every assistant turn is trained on, a tool
    call as Qwen's <tool_call> block, and tool results are not."""
    import json as _json

    data_file = SHARED / "data" / "glaive_toolcall_en_demo.json"
    if not data_file.exists():
        pytest.skip("../shared/fixtures/data not present")
    from ftcore.context import DataContext
    from ftcore.reporter import Reporter
    from ftcore_plugins.common.chat import IGNORE
    from ftcore_plugins.data.json import JsonSource
    from ftcore_plugins.templates.qwen25 import Qwen25Template

    source = JsonSource(JsonSource.Options.model_validate({"path": str(data_file)}))
    rows = source.load(DataContext(None, Reporter(None, None, None, None), "glaive"))
    i = next(i for i, r in enumerate(rows) if any(m["tool_calls"] for m in r["messages"]))
    got = prep([rows[i]], qwen(), Qwen25Template(), max_length=None, use_cache=False)
    ids, labels = got.dataset["input_ids"][0], got.dataset["labels"][0]
    tok = qwen()
    runs, current = [], []
    for t, lab in zip(ids, labels):
        if lab != IGNORE:
            current.append(t)
        elif current:
            runs.append(tok.decode(current))
            current = []
    assistant = [m for m in rows[i]["messages"] if m["role"] == "assistant"]
    assert len(runs) == len(assistant)
    for run, message in zip(runs, assistant):
        assert run.endswith("<|im_end|>")
        if message["tool_calls"]:
            call = _json.loads(message["tool_calls"])[0]["function"]
            assert "<tool_call>" in run and call["name"] in run
        else:
            assert run == message["content"] + "<|im_end|>"
    tool_results = [m["content"] for m in rows[i]["messages"] if m["role"] == "tool"]
    assert tool_results and not any(r in run for r in tool_results for run in runs)


def test_a_padded_call_before_does_not_pad_the_samples():
    """transformers leaves padding on in the Rust tokenizer after tokenizer(..., padding=True),
    as exact_match's batch generation does before training: tokenization must not inherit it."""
    tok, template = qwen(), chatml()
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
            {"messages": LONG}]
    clean = prep(rows, tok, template, max_length=None, use_cache=False)
    tok(["short", "a much longer text than the first one"], padding=True)
    after = prep(rows, tok, template, max_length=None, use_cache=False)
    assert after.dataset["input_ids"] == clean.dataset["input_ids"]
    assert len(after.dataset["input_ids"][0]) < len(after.dataset["input_ids"][1])
