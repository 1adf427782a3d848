"""The ``autoround`` export: the merged model with 4-bit weights calibrated by AutoRound on the run's own rows,
in the compressed-tensors and GPTQ layouts, reloaded by transformers (a tiny local Llama, on a CPU)."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from conftest import chat_rows, run_cli, write_jsonl

pytest.importorskip("torch")

PLAN = """
[run]
name = "ar"
seed = 3

[model]
use = "hf"
path = "base"

[template]
use = "chatml"

[adapter]
use = "lora"
r = 8
lora_alpha = 16

[data.chat]
use = "jsonl"
path = "chat.jsonl"

[data.held]
use = "jsonl"
path = "held.jsonl"

[[stage]]
name = "sft"
trainer = "sft"
data = "chat"
eval_data = "held"
max_steps = 4
batch_size = 8
max_length = 64
learning_rate = 1e-2

[[export]]
use = "merged"

[[export]]
use = "autoround"
group_size = 32
iters = 20
nsamples = 8
seqlen = 64
{extra}
"""


@pytest.fixture
def project(tmp_path, tiny_llama):
    shutil.copytree(tiny_llama, tmp_path / "base")
    write_jsonl(tmp_path / "chat.jsonl", chat_rows(64))
    write_jsonl(tmp_path / "held.jsonl", chat_rows(96)[64:])
    return tmp_path


def test_validate_refuses_calibration_data_the_plan_lacks(project):
    pytest.importorskip("auto_round")
    (project / "plan.toml").write_text(PLAN.format(extra='data = "missing"'))
    result = run_cli("validate", "plan.toml", cwd=project)
    assert result.returncode == 2, result.stdout + result.stderr
    assert 'data: "missing" names no [data.<name>] of the plan; it has: chat, held' in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["compressed-tensors", "gptq"])
def test_the_export_is_calibrated_on_the_eval_rows_and_reloads_in_transformers(project, layout):
    pytest.importorskip("auto_round")
    import torch
    from transformers import AutoModelForCausalLM, AutoRoundConfig

    (project / "plan.toml").write_text(PLAN.format(extra=f'format = "{layout}"'))
    result = run_cli("run", "plan.toml", cwd=project)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    exports = project / "runs" / "ar" / "exports"
    config = json.loads((exports / "autoround" / "config.json").read_text())["quantization_config"]
    card = (exports / "autoround" / "README.md").read_text()
    assert f"{layout} layout; 20 SignRound steps a block on 8 windows of held" in card, card
    stated = float(re.search(r"\| max_abs_logit_diff_vs_merged \(quantization error\) \| ([0-9.e-]+) \|", card)[1])
    reloaded = float(re.search(r"\| max_abs_logit_diff_reloaded \| ([0-9.e-]+) \|", card)[1])
    if layout == "compressed-tensors":
        assert config["quant_method"] == "compressed-tensors" and config["format"] == "pack-quantized"
        quantized = AutoModelForCausalLM.from_pretrained(exports / "autoround")  # plain transformers
        assert reloaded == 0
    else:
        assert config["quant_method"] == "gptq" and config["bits"] == 4 and config["group_size"] == 32
        quantized = AutoModelForCausalLM.from_pretrained(exports / "autoround", quantization_config=AutoRoundConfig(),
                                                         device_map="cpu")
        assert reloaded <= 0.05  # fp16 on a CPU
        assert type(quantized.model.layers[0].mlp.down_proj) is not torch.nn.Linear  # auto-round's QuantLinear
    # The stated quantization error, measured again from the files: the export against the merged export.
    merged = AutoModelForCausalLM.from_pretrained(exports / "merged").eval()
    tok_ids = torch.tensor([[5, 17, 42, 99, 7, 3, 150, 60]])
    with torch.no_grad():
        error = (quantized.eval()(input_ids=tok_ids).logits.float() - merged(input_ids=tok_ids).logits).abs().max()
    assert 1e-4 < stated < 1 and 1e-4 < float(error) < 1, (stated, float(error))
    print(f"\nautoround {layout}: reloaded within {reloaded:.3g}; quantization error {stated:.3g} (card), "
          f"{float(error):.3g} on other ids")  # RESULTS.md (-s)
