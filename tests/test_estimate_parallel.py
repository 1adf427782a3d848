"""``ftcore estimate`` per rank under ``[distributed]``'s axes (issue #43): sequence parallelism (Ulysses) splits
the activations, ZeRO partitions the gradients and optimizer state over data parallel x sp, context and tensor
parallelism are computed and labelled unmeasured; the output says which axes applied. The measured side is
benchmarks/sequence_parallel_memory.py (tests/test_benchmarks.py)."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli

MiB = 2**20
PLAN = """[run]
name = "sp"
seed = 1

[model]
use = "scratch"
hidden_size = 64
num_layers = 4
num_heads = 4
num_kv_heads = 2
intermediate_size = 256
max_position_embeddings = 8192
vocab_size = 512
tokenizer_data = ["corpus"]

[data.corpus]
use = "jsonl"
path = "text.jsonl"

[[stage]]
name = "pretrain"
trainer = "pretrain"
data = "corpus"
adapter = "full"
batch_size = 1
max_length = 8192
"""
SP = '\n[distributed]\nengine = "deepspeed"\nnproc_per_node = {n}\nsp_size = {sp}\n'


def estimate(tmp_path, text, *flags, name="plan.toml"):
    (tmp_path / "text.jsonl").write_text('{"text": "a b c"}\n')
    plan = tmp_path / name
    plan.write_text(text)
    return run_cli("estimate", str(plan), "--device", "cpu", *flags)


def test_sequence_parallel_is_per_rank_and_says_which_axes_applied(tmp_path):
    one = json.loads(estimate(tmp_path, PLAN, "--json").stdout)
    r = estimate(tmp_path, PLAN + SP.format(n=4, sp=2), "--json", name="sp.toml")
    assert r.returncode == 0, r.stderr
    two = json.loads(r.stdout)
    assert one["per"] == "process" and one["parallel"] is None and one["stages"][0]["axes"] == []
    assert two["per"] == "rank" and two["parallel"]["sp"] == 2 and two["parallel"]["data_parallel"] == 2
    assert two["parallel"]["shards"] == 4  # ZeRO partitions over the seq_data_parallel group: every rank
    a, b = one["stages"][0]["bytes"], two["stages"][0]["bytes"]
    # Every activation is for half of each row's columns (2 key/value heads, sp 2: one a rank, none copied), and
    # Ulysses' one more query-wide tensor a layer (4 layers, and the one in backward on CPU), 4,096 columns x 64.
    assert b["activations"] == pytest.approx(a["activations"] / 2 + 5 * 4096 * 64 * 4, rel=0.01)
    # ZeRO-2 over 4 ranks: the optimizer state and an fp32 master copy of a quarter each, the fp32 gradients of a
    # quarter plus the reduce bucket (on CPU, the pages the gradients fill: all of them); weights whole.
    params = one["stages"][0]["params"]["trainable"]
    assert b["weights"] == a["weights"]
    assert b["gradients"] == params * 4 // 4 + params * 4
    assert b["optimizer"] == pytest.approx(a["optimizer"] / 4 + params * 4 / 4, abs=16)
    text = estimate(tmp_path, PLAN + SP.format(n=4, sp=2), name="sp.toml").stdout
    assert "per rank of 4" in text and "every figure is one rank's" in text
    assert "applied: sequence parallel sp_size 2 (DeepSpeed Ulysses): activations per rank for 4,096 of each " \
           "row's 8,192 columns" in text
    assert "applied: DeepSpeed ZeRO-2 over 4 ranks (data parallel 2 x sp 2)" in text


def test_key_value_heads_fewer_than_sp_size_are_copied_to_every_rank():
    from ftcore_plugins.common.estimate import split_dims

    # hidden 64, 4 heads of 16, 2 key/value heads: split 4 ways each rank gets one query head over the whole row
    # and a copy of a key/value head, as wide per token of its slice as 4 key/value heads.
    dims = (64, 4, 4, 64, 32, 256, 512)
    assert split_dims(dims, 2) == dims
    assert split_dims(dims, 4) == (64, 4, 4, 64, 64, 256, 512)
    # Tensor parallelism: the heads, key/value heads and MLP of the sharded projections, the residual whole.
    assert split_dims(dims, 1, 2) == (64, 4, 2, 32, 16, 128, 512)


def test_context_and_tensor_parallel_are_computed_and_labelled_unmeasured():
    """cp_size and tp_size run on GPUs only (plan validation on this CPU machine refuses them): their per-rank
    figures are the estimate's accounting, checked here on the meta model."""
    import torch
    from transformers import LlamaConfig

    from ftcore_plugins.commands.estimate import Parallel, Settings, _shard
    from ftcore_plugins.common.estimate import meta_model_from_config

    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=256, vocab_size=512)
    model = meta_model_from_config(config, torch.bfloat16)
    params = list(model.parameters())
    weights = sum(p.numel() * 2 for p in params)
    linear = sum(p.numel() * 2 for n, p in model.named_parameters() if "_proj" in n)
    settings = Settings(1, 4096, False, "adamw_torch", "bf16")
    axes: list[str] = []
    w, g, s, t = _shard(Parallel(4, "fsdp", tp=2), model, config, params, weights, weights, 4 * weights, 0,
                        "cuda", settings, axes, {"optimizer": ""})
    assert w == (weights - linear // 2) // 2  # the projections / tp, then FSDP2's full shard over the other 2
    assert g == (weights - linear // 2) // 2 and s == 4 * (weights - linear // 2) // 2
    assert any("tensor parallel tp_size 2" in a and "unmeasured" in a for a in axes)
    axes = []
    _shard(Parallel(2, "fsdp", cp=2), model, config, params, weights, weights, 4 * weights, 0, "cuda", settings,
           axes, {"optimizer": ""})
    assert any(a.startswith("context parallel cp_size 2: activations per rank for 2,048 of each row's 4,096") and
               "unmeasured" in a for a in axes)


def test_a_model_sp_size_cannot_split_is_one_line_naming_the_key(tmp_path):
    r = estimate(tmp_path, PLAN.replace("max_length = 8192", "max_length = 8190") + SP.format(n=3, sp=3))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert "plan.toml" in line and "sp_size" in line
