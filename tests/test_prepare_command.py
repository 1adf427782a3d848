"""`ftcore prepare`: only the data preparation, into the cache a later run reads, without weights
and without a run folder."""

from __future__ import annotations

import json
import os

import pytest

from conftest import SHARED, chat_rows, run_cli, write_jsonl

pytestmark = pytest.mark.slow


def cache_entries(env: dict) -> set[str]:
    root = os.path.join(env["FTCORE_CACHE_DIR"], "tokenized")
    return {e for d in os.listdir(root) for e in os.listdir(os.path.join(root, d)) if not e.startswith(".")} \
        if os.path.isdir(root) else set()


def test_prepare_fills_the_cache_the_run_then_hits(tiny_project, tmp_path):
    """A scratch model whose tokenizer is trained on the plan's data: prepare trains the same one
    (deterministically) and the run finds every split in the cache; the DPO stage says it
    tokenizes as it trains."""
    write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": f"Say {w}.", "chosen": f"{w}.", "rejected": "No."}
                                           for w in ("yes", "maybe", "sure", "fine") * 4])
    plan = tiny_project("""
[data.pairs]
use = "jsonl"
path = "pairs.jsonl"

[[stage]]
name = "pre"
trainer = "pretrain"
data = "text"
max_length = 64
max_steps = 2
batch_size = 4

[[stage]]
name = "sft"
trainer = "sft"
adapter = "lora"
data = "chat"
eval_data = "chat_eval"
max_length = 64
max_steps = 2
batch_size = 4

[[stage]]
name = "dpo"
trainer = "dpo"
adapter = "lora"
data = "pairs"
max_steps = 1
batch_size = 2
""")
    env = {"FTCORE_CACHE_DIR": str(tmp_path / "cache")}
    prepared = run_cli("prepare", str(plan), env=env)
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    assert "stage pre: prepared" in prepared.stdout and "stage sft: prepared" in prepared.stdout
    assert "stage dpo: trainer 'dpo' tokenizes its data as it trains" in prepared.stdout
    assert not (tmp_path / "runs").exists()  # no run folder, no trained tokenizer left behind
    entries = cache_entries(env)
    assert len(entries) == 3  # pre/train, sft/train, sft/eval

    ran = run_cli("run", str(plan), env=env)
    assert ran.returncode == 0, ran.stderr[-3000:]
    report = json.loads((tmp_path / "runs" / "tiny" / "data_report.json").read_text())
    assert {k: v["cache"] for k, v in report.items() if "cache" in v} == \
        {"pre/train": "hit", "sft/train": "hit", "sft/eval": "hit"}
    assert cache_entries(env) == entries

    only = run_cli("prepare", str(plan), "--stage", "sft", env=env)
    assert only.returncode == 0 and "stage pre" not in only.stdout and "stage sft: prepared" in only.stdout
    wrong = run_cli("prepare", str(plan), "--stage", "nope", env=env)
    assert wrong.returncode == 2 and "no stage named 'nope'; stages: pre, sft, dpo" in wrong.stderr
    assert "Traceback" not in wrong.stderr


def test_prepare_adds_the_templates_tokens_as_the_run_does(tmp_path):
    """A real Llama 3 tokenizer lacks chatml's markers: the template adds them on a meta-device
    model (no weights read), and the run, which adds them to the loaded model, hits the cache."""
    folder = SHARED / "tokenizers" / "llama3"
    if not folder.exists():
        pytest.skip("../shared/fixtures/tokenizers/llama3 not present")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    assert "<|im_start|>" not in tok.get_vocab()
    config = AutoConfig.for_model("llama", vocab_size=len(tok), hidden_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=64, max_position_embeddings=256)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    write_jsonl(tmp_path / "chat.jsonl", chat_rows(16))
    plan = tmp_path / "plan.toml"
    plan.write_text("""
[run]
name = "llama"

[model]
use = "hf"
path = "base"
dtype = "float32"

[template]
use = "chatml"

[adapter]
use = "lora"
r = 4

[data.chat]
use = "jsonl"
path = "chat.jsonl"

[[stage]]
trainer = "sft"
data = "chat"
max_steps = 1
batch_size = 4
""")
    env = {"FTCORE_CACHE_DIR": str(tmp_path / "cache")}
    prepared = run_cli("prepare", str(plan), env=env)
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    ran = run_cli("run", str(plan), env=env)
    assert ran.returncode == 0, ran.stderr[-3000:]
    report = json.loads((tmp_path / "runs" / "llama" / "data_report.json").read_text())
    assert {k: v["cache"] for k, v in report.items() if "cache" in v} == {"0-sft/train": "hit"}
