"""``ftcore estimate --gpu``: FLOPs per token against torch's own FLOP counter, tokens per epoch
against the tokenized data, and hours and cost by their formula."""

from __future__ import annotations

import json

import pytest

from conftest import SHARED, chat_rows, run_cli, write_jsonl

from ftcore_plugins.commands._compute import flops_per_token


def tiny_llama(layers: int = 8):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=512, hidden_size=64, num_hidden_layers=layers,
                                  num_attention_heads=4, num_key_value_heads=4, intermediate_size=176,
                                  max_position_embeddings=128, tie_word_embeddings=True)
    torch.manual_seed(0)
    # Eager attention: its matmuls are what torch's FLOP counter sees (SDPA's CPU kernel is not counted).
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager"), config


def counted_flops(model, batch: int, length: int) -> int:
    """Forward and backward of one batch, counted by torch.utils.flop_counter (an independent count)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    ids = torch.randint(0, 512, (batch, length))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    return counter.get_total_flops()


def compute_params(model) -> int:
    from ftcore_plugins.commands.estimate import _compute_params

    return _compute_params(model)


@pytest.mark.parametrize("length", [32, 96])
def test_full_fine_tuning_flops_per_token_match_torch_s_count(length):
    model, config = tiny_llama()
    batch = 2
    measured = counted_flops(model, batch, length)
    n = compute_params(model)
    predicted, formula = flops_per_token(n, n, full=True, layers=8, hidden=64, seq_len=length,
                                         checkpointing=False, reference=False)
    assert formula.startswith("6N + 3A")
    assert predicted * batch * length == pytest.approx(measured, rel=0.01)


def test_lora_flops_per_token_match_torch_s_count():
    """4N + 2N_trainable + 3A, less what autograd skips and the formula keeps: the input gradient of
    the first layer's q/k/v projections (their input, the frozen embedding's output, needs none)."""
    from peft import LoraConfig, get_peft_model

    model, config = tiny_llama()
    base = compute_params(model)
    model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    batch, length = 2, 64
    measured = counted_flops(model, batch, length)
    predicted, _ = flops_per_token(base, trainable, full=False, layers=8, hidden=64, seq_len=length,
                                   checkpointing=False, reference=False)
    first = model.base_model.model.model.layers[0].self_attn
    skipped = sum(2 * (m.base_layer.weight.numel() + m.lora_A["default"].weight.numel())
                  for m in (first.q_proj, first.k_proj, first.v_proj))
    assert (predicted - skipped) * batch * length == pytest.approx(measured, rel=0.01)
    assert predicted * batch * length > measured  # the formula errs on the side of more


def config_folder(folder):
    """A model folder with a tiny Qwen2 config (no weights: the estimate reads the config) and the
    real Qwen2.5 tokenizer; returns the tokenizer."""
    tokenizer = SHARED / "tokenizers" / "qwen25"
    if not tokenizer.exists():
        pytest.skip("../shared/fixtures/tokenizers/qwen25 not present")
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    AutoConfig.for_model("qwen2", vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=4096,
                         tie_word_embeddings=True).save_pretrained(folder)
    tok.save_pretrained(folder)
    return tok


def test_time_and_cost_by_their_formula_on_the_tokenized_data(tmp_path):
    from ftcore_plugins.common.prepare import prepare
    from ftcore_plugins.templates.chatml import ChatMLTemplate

    tok = config_folder(tmp_path / "model")
    rows = chat_rows(300)
    write_jsonl(tmp_path / "chat.jsonl", rows)
    (tmp_path / "plan.toml").write_text("""
[model]
use = "hf"
path = "model"

[template]
use = "chatml"

[adapter]
use = "lora"
r = 8

[data.chat]
use = "jsonl"
path = "chat.jsonl"

[[stage]]
trainer = "sft"
data = "chat"
epochs = 2
max_length = 48
""")
    r = run_cli("estimate", str(tmp_path / "plan.toml"), "--gpu", "a100", "--gpus", "4", "--price", "1.5", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    compute = json.loads(r.stdout)["compute"]
    stage = compute["stages"][0]
    import datasets

    expected = prepare(datasets.Dataset.from_list(rows), tok, ChatMLTemplate(), max_length=48,
                       use_cache=False).stats["tokens"]
    assert stage["tokens_per_epoch"] == expected and stage["tokens"] == 2 * expected  # all 300 rows: exact
    assert compute["peak_flops"] == 312e12 and compute["mfu"] == 0.35
    hours = stage["tokens"] * stage["flops_per_token"] / (4 * 312e12 * 0.35) / 3600
    assert stage["hours"] == pytest.approx(hours) and compute["cost"] == pytest.approx(hours * 4 * 1.5)

    shown = run_cli("estimate", str(tmp_path / "plan.toml"), "--gpu", "a100", "--gpus", "4", "--price", "1.5")
    assert f"{stage['tokens']:,}" in shown.stdout and "formula: hours = tokens x FLOPs per token" in shown.stdout
    wrong = run_cli("estimate", str(tmp_path / "plan.toml"), "--price", "2")
    assert wrong.returncode == 2 and "add --gpu TYPE" in wrong.stderr and "Traceback" not in wrong.stderr


def test_preference_pairs_count_both_sides_and_the_reference_forward(tmp_path):
    """DPO on the real DPO demo: tokens per epoch are prompt + chosen and prompt + rejected, all
    300 pairs tokenized; FLOPs per token add the reference model's forward."""
    pairs = SHARED / "data" / "dpo_en_demo.json"
    if not pairs.exists():
        pytest.skip("../shared/fixtures/data/dpo_en_demo.json not present")
    from ftcore_plugins.common.chat import chosen_as_chat, encode
    from ftcore_plugins.templates.chatml import ChatMLTemplate

    tok = config_folder(tmp_path / "model")
    (tmp_path / "plan.toml").write_text(f"""
[model]
use = "hf"
path = "model"

[template]
use = "chatml"

[adapter]
use = "lora"

[data.pairs]
use = "json"
path = "{pairs}"

[[stage]]
trainer = "dpo"
data = "pairs"
max_length = 1024
""")
    r = run_cli("estimate", str(tmp_path / "plan.toml"), "--gpu", "h100-sxm", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    stage = json.loads(r.stdout)["compute"]["stages"][0]
    from test_sources import load_data

    rows = load_data(tmp_path, f'use = "json"\npath = "{pairs}"\n').ds
    expected = sum(encode(chosen_as_chat(rows, side), tok, ChatMLTemplate(), max_length=1024,
                          train_on_inputs=True)[1].tokens for side in ("chosen", "rejected"))
    assert stage["tokens_per_epoch"] == expected
    assert "the reference model's forward" in stage["flops_formula"]
