"""Checkpoints that ship quantized (plugins/models/_prequantized.py): a compressed-tensors W4A16 checkpoint made
here with compressed-tensors' own API and gpt-oss with MXFP4 experts train LoRA through a plan, dequantized as
they load (and the run says so); the adapter reloads in peft on the same quantized base and equals the merged
export. What cannot train here is refused by ``validate`` in one line, naming the format and the reason."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from conftest import chat_rows, run_cli, write_jsonl

pytest.importorskip("torch")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def tiny_llama_128(tiny_llama, folder, seed=0):
    """tiny_llama's tokenizer on a Llama wide enough for 128-weight quantization groups."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_llama)
    config.update({"hidden_size": 128, "intermediate_size": 256, "head_dim": 32})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    folder.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if (tiny_llama / name).exists():
            shutil.copy(tiny_llama / name, folder / name)
    return model


@pytest.fixture(scope="module")
def ct_checkpoint(tiny_llama, tmp_path_factory):
    """W4A16 (4-bit weights in groups of 128, packed) made with compressed-tensors' API: its scheme applied,
    each group's scale and zero point from its min and max (``calculate_qparams``), then compressed and saved with
    the quantization_config llm-compressor writes."""
    pytest.importorskip("compressed_tensors")
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, QuantizationStatus, apply_quantization_config,
                                                 preset_name_to_scheme)
    from compressed_tensors.quantization.utils import calculate_qparams, is_module_quantized

    folder = tmp_path_factory.mktemp("ct") / "w4a16"
    model = tiny_llama_128(tiny_llama, folder)
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("W4A16", ["Linear"])},
                                ignore=["lm_head"])
    apply_quantization_config(model, config)
    for module in model.modules():
        if is_module_quantized(module):
            args = module.quantization_scheme.weights
            w = module.weight.data.reshape(module.weight.shape[0], -1, args.group_size)
            scale, zero = calculate_qparams(w.amin(-1), w.amax(-1), args)
            module.weight_scale.data.copy_(scale)
            module.weight_zero_point.data.copy_(zero.to(module.weight_zero_point.dtype))
            module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(folder)
    assert json.loads((folder / "config.json").read_text())["quantization_config"]["format"] == "pack-quantized"
    return folder


PLAN = """
[run]
name = "pq"
seed = 3

[model]
use = "hf"
path = "{path}"
{tokenizer}
[template]
use = "chatml"

[adapter]
use = "lora"
r = 8
lora_alpha = 16

[data.chat]
use = "jsonl"
path = "chat.jsonl"

[[stage]]
name = "sft"
trainer = "sft"
data = "chat"
max_steps = 8
batch_size = 8
max_length = 64
learning_rate = 1e-2
logging_steps = 1

[[export]]
use = "adapter"
{more}"""


def run(tmp_path, path, tokenizer="", more='\n[[export]]\nuse = "merged"\n'):
    write_jsonl(tmp_path / "chat.jsonl", chat_rows(64))
    (tmp_path / "plan.toml").write_text(PLAN.format(path=path, tokenizer=tokenizer, more=more))
    result = run_cli("run", "plan.toml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    folder = tmp_path / "runs" / "pq"
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if r.get("stage") == "sft" and "loss" in r]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.5, losses
    return folder, rows


@pytest.mark.slow
def test_a_compressed_tensors_checkpoint_trains_lora_and_its_adapter_reloads_on_the_same_base(tmp_path,
                                                                                               ct_checkpoint):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    folder, rows = run(tmp_path, ct_checkpoint)
    assert "model: the checkpoint's compressed-tensors weights are dequantized to the compute dtype as they load" \
        in (folder / "run.log").read_text()
    export = next(r for r in rows if r.get("stage") == "export:merged")
    assert export["max_abs_logit_diff"] <= export["tolerance"] == 1e-4

    # The adapter on the same quantized checkpoint, in plain transformers and peft, against the merged export.
    base = AutoModelForCausalLM.from_pretrained(ct_checkpoint, quantization_config=CompressedTensorsConfig(
        dequantize=True))
    adapted = PeftModel.from_pretrained(base, folder / "exports" / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(folder / "exports" / "merged").eval()
    assert "quantization_config" not in json.loads((folder / "exports" / "merged" / "config.json").read_text())
    ids = torch.tensor([[5, 17, 42, 99, 7, 3, 150, 60]])
    with torch.no_grad():
        diff = (adapted(input_ids=ids).logits - merged(input_ids=ids).logits).abs().max().item()
    assert diff < 1e-4, diff
    # The dequantized base is the 4-bit one: its weights take at most 16 values per group.
    w = base.model.layers[0].mlp.down_proj.weight.reshape(-1, 128)
    assert max(len(torch.unique(row)) for row in w) <= 16


def mxfp4(w):
    """gpt-oss's MXFP4 layout (transformers/integrations/mxfp4.py) of an expert tensor ``[experts, in, out]``:
    blocks ``[experts, out, in/32, 16]`` of two e2m1 codes a byte, scales ``[experts, out, in/32]`` as a power of
    two + 127. Made by hand: no library here quantizes to MXFP4 on a CPU (transformers' needs Triton)."""
    import torch

    values = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    t = w.float().transpose(1, 2).contiguous()
    e, o, i = t.shape
    groups = t.reshape(e, o, i // 32, 32)
    exp = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=2.0 ** -126) / 6.0)).clamp(-127, 127)
    x = groups / torch.pow(2.0, exp)[..., None]
    magnitude = (x.abs()[..., None] - values).abs().argmin(-1)
    code = torch.where(magnitude == 0, 0, magnitude + 8 * (x < 0).long())
    return (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8), (exp + 127).to(torch.uint8)


@pytest.mark.slow
def test_gpt_oss_with_mxfp4_experts_trains_after_dequantizing_and_says_so(tmp_path, tiny_llama):
    import torch
    from safetensors.torch import save_file
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                          vocab_size=512, sliding_window=32, max_position_embeddings=256,
                          layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False)
    torch.manual_seed(0)
    model = GptOssForCausalLM(config).to(torch.bfloat16)
    folder = tmp_path / "gpt-oss-mxfp4"
    model.save_pretrained(folder)
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            tensors[name + "_blocks"], tensors[name + "_scales"] = mxfp4(tensor)
        else:
            tensors[name] = tensor.contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((folder / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(raw))

    run_folder, _ = run(tmp_path, folder, tokenizer=f'tokenizer = "{tiny_llama}"\n', more="")
    log = (run_folder / "run.log").read_text()
    assert "model: the checkpoint's mxfp4 weights are dequantized to the compute dtype as they load" in log
    # The default all-linear targets reach the routed experts' parameters (peft's target_parameters).
    adapter = json.loads((run_folder / "exports" / "adapter" / "adapter_config.json").read_text())
    assert set(adapter["target_parameters"]) >= {"experts.gate_up_proj", "experts.down_proj"}, adapter


# -- what validate refuses -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("case,quantization,plan_change,expected", [
    ("gptq without gptqmodel", {"quant_method": "gptq", "bits": 4}, None,
     r"is a gptq checkpoint, which loads through gptqmodel( and optimum)?: pip install gptqmodel"),
    ("a format ftcore does not train", {"quant_method": "aqlm"}, None,
     r"is quantized with aqlm, which ftcore does not train on \(it trains compressed-tensors, fp8, mxfp4, gptq, "
     r"awq, bitsandbytes checkpoints\)"),
    ("quantizing it again", {"quant_method": "fp8"}, ('[template]', '[quantizer]\nuse = "bnb-nf4"\n\n[template]'),
     r"is already quantized \(fp8\); quantizer 'bnb-nf4' would quantize it again: use \[quantizer\] use = \"none\""),
    ("full fine-tuning of 4-bit weights", {"quant_method": "bitsandbytes", "load_in_4bit": True},
     ('[adapter]\nuse = "lora"\nr = 8\nlora_alpha = 16', '[adapter]\nuse = "full"'),
     r"holds bitsandbytes weights, which cannot be trained: stage 'sft' uses adapter 'full'"),
    ("a merge into 4-bit weights", {"quant_method": "bitsandbytes", "load_in_4bit": True}, None,
     r"holds bitsandbytes weights, which peft cannot merge an adapter into: \[\[export\]\] use = \"merged\" is "
     r"refused; export the adapter"),
])
def test_validate_refuses_what_a_prequantized_checkpoint_cannot_do(tmp_path, tiny_llama, case, quantization,
                                                                      plan_change, expected):
    if case == "gptq without gptqmodel":
        from ftcore_plugins.models._prequantized import _installed

        if _installed("gptqmodel") and _installed("optimum.gptq"):
            pytest.skip("gptqmodel and optimum are installed")
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "quantization_config": quantization}))
    write_jsonl(tmp_path / "chat.jsonl", chat_rows(4))
    text = PLAN.format(path=folder, tokenizer="", more='\n[[export]]\nuse = "merged"\n')
    if plan_change:
        text = text.replace(*plan_change)
    if case == "full fine-tuning of 4-bit weights":
        text = text.replace('[[export]]\nuse = "adapter"\n', "")
    (tmp_path / "plan.toml").write_text(text)
    result = run_cli("validate", "plan.toml", cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if re.search(expected, line)]
    assert len(lines) == 1 and lines[0].startswith(f"plan.toml: model.path: {folder / 'config.json'} "), \
        (case, result.stderr)
    assert "Traceback" not in result.stderr
