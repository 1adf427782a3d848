"""The `hf` model loader on a local folder with a real tokenizer and its native chat
template, and a clear error for a model that cannot be reached."""

from __future__ import annotations

import json

import pytest

from conftest import chat_rows, run_cli, write_jsonl

pytestmark = pytest.mark.slow


def test_hf_loader_native_template_sft_and_merged_export(tmp_path, qwen25_tiny_model):
    from transformers import AutoModelForCausalLM

    write_jsonl(tmp_path / "chat.jsonl", chat_rows(24))
    plan = tmp_path / "plan.toml"
    plan.write_text("""
[run]
name = "hf"

[model]
use = "hf"
path = "base-model"
dtype = "float32"

[template]
use = "native"

[adapter]
use = "lora"
r = 4

[data.chat]
use = "jsonl"
path = "chat.jsonl"

[[stage]]
trainer = "sft"
data = "chat"
max_steps = 4
batch_size = 4
learning_rate = 1e-2

[[evaluate]]
use = "perplexity"
data = "chat"

[[export]]
use = "merged"
""")
    result = run_cli("run", str(plan))
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "runs" / "hf"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["evaluations"]["after"]["perplexity"]["perplexity"] < \
        summary["evaluations"]["before"]["perplexity"]["perplexity"]
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["plan"]["model"]["path"] == "base-model"
    assert "trust_remote_code" not in manifest["plan"]["model"]  # off, since the plan did not turn it on
    from transformers import AutoTokenizer

    merged = AutoModelForCausalLM.from_pretrained(run / "exports" / "merged")
    tok = AutoTokenizer.from_pretrained(run / "exports" / "merged")
    assert merged.config.vocab_size == AutoModelForCausalLM.from_pretrained(qwen25_tiny_model).config.vocab_size
    # The native template needed no new tokens, and the exported tokenizer renders it unchanged.
    assert tok.chat_template == AutoTokenizer.from_pretrained(qwen25_tiny_model).chat_template


def test_unreachable_hub_id_is_one_clear_line(tmp_path):
    write_jsonl(tmp_path / "chat.jsonl", chat_rows(4))
    plan = tmp_path / "plan.toml"
    plan.write_text("""
[model]
use = "hf"
path = "no-such-org/no-such-model"

[data.chat]
use = "jsonl"
path = "chat.jsonl"

[[evaluate]]
use = "perplexity"
data = "chat"
""")
    assert run_cli("validate", str(plan)).returncode == 0  # a hub id is valid where the network allows
    # Offline, an id missing from the local cache is refused with the plan's own check, before any work.
    result = run_cli("run", str(plan), env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "empty-hf-home")})
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"{plan}: model.path: no such folder: {tmp_path.resolve() / 'no-such-org/no-such-model'} (nor a model in the "
        "Hugging Face cache, and HF_HUB_OFFLINE is set) (got 'no-such-org/no-such-model')"]
    assert not (tmp_path / "runs").exists()


def test_secrets_never_reach_the_manifest(tmp_path, qwen25_tiny_model):
    write_jsonl(tmp_path / "chat.jsonl", chat_rows(4))
    plan = tmp_path / "plan.toml"
    plan.write_text("""
[run]
name = "secret"

[model]
use = "hf"
path = "base-model"
token = "hf_SECRET_value_123"

[data.chat]
use = "jsonl"
path = "chat.jsonl"

[[evaluate]]
use = "perplexity"
data = "chat"
when = "before"
max_length = 64

[[evaluate]]
use = "exact_match"
data = "chat"
when = "before"
max_new_tokens = 4
""")
    result = run_cli("run", str(plan), env={"HF_TOKEN": "hf_ENV_secret_456"})
    assert result.returncode == 0, result.stderr[-2000:]
    manifest = json.loads((tmp_path / "runs" / "secret" / "manifest.json").read_text())
    assert manifest["plan"]["model"]["token"] == "***"
    assert manifest["plan"]["evaluate"][0]["max_length"] == 64  # only secret-looking keys are hidden
    assert manifest["plan"]["evaluate"][1]["max_new_tokens"] == 4
    for path in (tmp_path / "runs" / "secret").rglob("*"):
        if path.is_file():
            text = path.read_text(errors="ignore")
            assert "hf_SECRET_value_123" not in text and "hf_ENV_secret_456" not in text, path


def test_a_bf16_checkpoint_loads_at_float32_tensor_by_tensor(tmp_path):
    """``dtype = "float32"`` from a bf16 checkpoint: read in bf16 (the file's pages untouched), raised
    one tensor at a time with each one's file pages handed back. The weights equal transformers' own
    float32 load bit for bit, and tied weights stay tied."""
    import subprocess
    import sys

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen2", vocab_size=4096, hidden_size=256, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, intermediate_size=1024,
                                  tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    probe = """
import json, sys, torch
from transformers import AutoModelForCausalLM
from ftcore_plugins.models._upcast import upcast
from ftcore_plugins.models.hf import HFModelLoader
loader = HFModelLoader(HFModelLoader.Options(path=sys.argv[1], dtype="float32"))
stored = loader._stored_dtype({})
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=stored)
released = upcast(model, torch.float32)
ref = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
print(json.dumps({"stored": stored, "released": released,
                  "bf16_bytes": sum(p.numel() * 2 for p in ref.parameters()),
                  "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
                  "tied": model.lm_head.weight is model.model.embed_tokens.weight,
                  "equal": all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))}))
"""
    out = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "bf16")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["stored"] == "bfloat16" and result["dtypes"] == ["torch.float32"]
    assert result["tied"] and result["equal"]
    if sys.platform.startswith("linux"):  # the file's pages were handed back (but those shared by two tensors)
        assert result["released"] > 0.9 * result["bf16_bytes"], result
