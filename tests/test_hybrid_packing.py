"""``packing = true`` on a hybrid model (linear attention, Mamba, short convolutions) whose CUDA kernels are
not installed: ``ftcore validate`` refuses it in one line, before anything loads, rather than the stage
failing inside ``train()`` ("can't keep packed sequences apart without causal_conv1d").

Each hybrid family this transformers has is saved as a tiny folder for the ``hf`` loader; the same plan
with ``packing = false`` validates, and so does a dense llama with ``packing = true``.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from conftest import run_cli

ENV = {**os.environ, "FTCORE_LOAD_PLUGINS": ""}

COMMON = dict(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              intermediate_size=64, max_position_embeddings=128)
# Two layers each: one that needs a kernel to keep packed samples apart, one of attention.
HYBRIDS = {
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"], linear_num_value_heads=2,
                       linear_num_key_heads=1, linear_key_head_dim=8, linear_value_head_dim=8, num_experts=2,
                       num_experts_per_tok=1, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                       head_dim=16),
    "qwen3_5_text": dict(layer_types=["linear_attention", "full_attention"], linear_num_value_heads=2,
                         linear_num_key_heads=1, linear_key_head_dim=8, linear_value_head_dim=8, head_dim=16),
    "nemotron_h": dict(layers_block_type=["mamba", "attention"], mamba_num_heads=4, mamba_head_dim=8,
                       ssm_state_size=8, n_groups=1, head_dim=16),
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
                             num_local_experts=2, num_experts_per_tok=1),
    "falcon_h1": dict(mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, head_dim=16),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  num_experts=2, num_experts_per_tok=1, mamba_d_state=8, mamba_dt_rank=4),
    "bamba": dict(attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8),
    "zamba2": dict(layers_block_type=["mamba", "hybrid"], mamba_headdim=8, n_mamba_heads=8, mamba_d_state=8,
                   attention_head_dim=16, num_mem_blocks=1),
}

def _known(model_type: str) -> bool:
    from transformers import CONFIG_MAPPING

    return model_type in CONFIG_MAPPING


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>", *[f"w{i}" for i in range(100)]]
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   unk_token="<unk>")


def model_folder(folder: Path, tokenizer, model_type: str, **fields) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**COMMON, **fields})
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _with_packing(ftcore_plan, folder: Path, packing: bool):
    from ftcore.testing import TINY_PLAN

    model = {"use": "hf", "path": str(folder), "hidden_size": None, "num_layers": None, "num_heads": None,
             "intermediate_size": None, "max_position_embeddings": None, "tokenizer_data": None, "vocab_size": None}
    stage = {**TINY_PLAN["stage"][0], "packing": packing}
    return ftcore_plan({"model": model, "stage": [stage]})


@pytest.mark.parametrize("model_type", list(HYBRIDS))
def test_packing_on_a_hybrid_without_its_kernels_is_one_line(tmp_path, ftcore_plan, tokenizer, model_type):
    if not _known(model_type):
        pytest.skip(f"this transformers has no {model_type}")
    if importlib.util.find_spec("causal_conv1d") is not None:  # every family here needs it
        pytest.skip("causal_conv1d is installed: packing is not refused")
    folder = model_folder(tmp_path / "model", tokenizer, model_type, **HYBRIDS[model_type])

    plan = _with_packing(ftcore_plan, folder, True)
    done = run_cli("validate", str(plan), env={**ENV, "PYTHONPROFILEIMPORTTIME": "1"}, timeout=300)
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
    assert imported and "torch" not in imported and "transformers" not in imported  # read from the files alone
    lines = [line for line in done.stderr.strip().splitlines() if not line.startswith("import time:")]
    assert done.returncode == 2, done.stdout + done.stderr
    assert len(lines) == 1, done.stderr
    line = lines[0]
    assert "stage[0].packing:" in line and f"the {model_type} model" in line, line
    assert "causal_conv1d" in line and "packing = false" in line, line
    assert "Traceback" not in done.stdout + done.stderr

    plan = _with_packing(ftcore_plan, folder, False)
    done = run_cli("validate", str(plan), env=ENV, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_packing_on_a_dense_model_validates(tmp_path, ftcore_plan, tokenizer):
    folder = model_folder(tmp_path / "model", tokenizer, "llama")
    done = run_cli("validate", str(_with_packing(ftcore_plan, folder, True)), env=ENV, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
