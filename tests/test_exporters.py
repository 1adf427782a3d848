"""The exporters `merged`, `adapter` and `onnx`, through real runs: what they write loads in the
libraries that consume it (transformers, peft, onnxruntime, huggingface_hub's ModelCard), and the
logits each consumer computes match the trained model's, computed here independently.

QLoRA runs for real on the CPU (bitsandbytes 4-bit); its tiny pretrained-looking Llama comes from
test_quantizers' fixture.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

import ftcore
from ftcore.errors import FtcoreError
from ftcore_plugins.adapters.lora import LoraAdapter

from conftest import chat_rows, run_cli, write_jsonl

PROMPTS = [[{"role": "user", "content": "Which is an animal? red fox tree"}],
           [{"role": "user", "content": "Which is an animal? the blue bird sees a stone"}]]

TWO_STAGES = """
[[stage]]
name = "pretrain"
trainer = "pretrain"
data = "text"
adapter = "full"
max_steps = 4
batch_size = 8
max_length = 64

[[stage]]
name = "sft"
trainer = "sft"
data = "chat"
adapter = { use = "lora", r = 4, lora_alpha = 8 }
max_steps = 6
batch_size = 4
max_length = 64
learning_rate = 1e-2

[[evaluate]]
use = "perplexity"
data = "chat_eval"

[[export]]
use = "merged"

[[export]]
use = "adapter"

[[export]]
use = "onnx"
"""


def encode(tokenizer, messages):
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]


def max_diff(a, b) -> float:
    return float((a - b).abs().max())


def model_logits(model, ids):
    import torch

    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def load_card(folder):
    from huggingface_hub import ModelCard

    return ModelCard.load(folder / "README.md")


@pytest.mark.slow
def test_lora_run_exports_a_merged_folder_an_adapter_and_onnx_that_their_libraries_load(tiny_project):
    import numpy as np
    import onnxruntime
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ftcore_plugins.templates.chatml import ChatMLTemplate

    result = run_cli("run", str(tiny_project(TWO_STAGES)))
    assert result.returncode == 0, result.stderr
    run = tiny_project.dir / "runs" / "tiny"
    merged_dir, adapter_dir, onnx_dir = (run / "exports" / n for n in ("merged", "adapter", "onnx"))

    # merged: a plain transformers folder, with the template as the tokenizer's chat template and
    # generation stopping at the end of turn; it generates.
    assert (merged_dir / "model.safetensors").exists()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    tok = AutoTokenizer.from_pretrained(merged_dir)
    assert tok.chat_template == ChatMLTemplate().chat_template()
    assert tok.convert_tokens_to_ids("<|im_end|>") in merged.generation_config.eos_token_id
    ids = encode(tok, PROMPTS[0])
    out = merged.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    assert out.shape[1] > ids.shape[1]

    # The adapter folder loads with plain peft on the model it was trained on (the pretrain stage's
    # output), and the merged model's logits equal that adapter model's.
    base = AutoModelForCausalLM.from_pretrained(run / "stages" / "pretrain" / "output").eval()
    bare = [model_logits(base, encode(tok, p)) for p in PROMPTS]
    adapter_model = PeftModel.from_pretrained(base, adapter_dir).eval()
    with_adapter = [model_logits(adapter_model, encode(tok, p)) for p in PROMPTS]
    folded = [model_logits(merged, encode(tok, p)) for p in PROMPTS]
    assert max(max_diff(a, b) for a, b in zip(with_adapter, bare)) > 1e-2  # the adapter learned something
    # The adapter names that exact base, which loads on its own (its tokenizer beside it): peft's
    # AutoPeftModel follows adapter_config.json alone to the same model.
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    recorded = json.loads((adapter_dir / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert Path(recorded) == run / "stages" / "pretrain" / "output"
    assert AutoTokenizer.from_pretrained(recorded).get_vocab() == tok.get_vocab()
    auto = AutoPeftModelForCausalLM.from_pretrained(adapter_dir).eval()
    assert max(max_diff(model_logits(auto, encode(tok, p)), a) for p, a in zip(PROMPTS, with_adapter)) < 1e-6
    lora_diff = max(max_diff(a, b) for a, b in zip(with_adapter, folded))
    assert lora_diff < 1e-4
    print(f"\nLoRA merge: max abs logit difference (test's own computation) {lora_diff:.3g}")

    # The cards parse, and carry the plan's fingerprint, the data files' hashes and the recorded check.
    manifest = json.loads((run / "manifest.json").read_text())
    chat_sha = hashlib.sha256((tiny_project.dir / "chat.jsonl").read_bytes()).hexdigest()
    card = load_card(merged_dir)
    assert card.data.library_name == "transformers" and "ftcore" in card.data.tags
    info = card.data.ftcore
    assert info["plan_fingerprint"] == manifest["plan_fingerprint"] and manifest["plan_fingerprint"] in card.text
    assert info["data_files"]["chat.jsonl"]["sha256"] == chat_sha and chat_sha in card.text
    for folder in (merged_dir, adapter_dir):  # a card names no path of this machine: it travels with the model
        assert str(tiny_project.dir) not in (folder / "README.md").read_text()
    assert 'from_pretrained("exports/merged")' in card.text
    recorded = info["verification"]
    assert recorded["prompts"] == 3 and 0 <= recorded["max_abs_logit_diff"] <= recorded["tolerance"] == 1e-4
    assert "perplexity/perplexity" in card.text  # the evaluation results, before and after
    adapter_card = load_card(adapter_dir)
    assert adapter_card.data.library_name == "peft" and "PeftModel.from_pretrained" in adapter_card.text
    assert 'from_pretrained("stages/pretrain/output")' in adapter_card.text  # the base, as the snippet loads it
    assert adapter_card.data.ftcore["plan_fingerprint"] == manifest["plan_fingerprint"]
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(r["stage"] == "export:merged" and r.get("max_abs_logit_diff") == recorded["max_abs_logit_diff"]
               for r in logged)

    # onnx: onnxruntime runs the graph on a left-padded batch (dynamic batch and sequence axes) and on a
    # single token; its logits match transformers' where the attention mask is 1.
    session = onnxruntime.InferenceSession(str(onnx_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    rows = [encode(tok, p)[0] for p in PROMPTS]
    width = max(len(r) for r in rows)
    batch = torch.full((len(rows), width), tok.pad_token_id)
    mask = torch.zeros_like(batch)
    for i, r in enumerate(rows):
        batch[i, width - len(r):], mask[i, width - len(r):] = r, 1
    worst = 0.0
    for ids, attention in [(batch, mask), (batch[:1, -1:], mask[:1, -1:])]:
        (got,) = session.run(["logits"], {"input_ids": ids.numpy(), "attention_mask": attention.numpy()})
        with torch.no_grad():
            want = merged(input_ids=ids, attention_mask=attention).logits.numpy()
        assert got.shape == want.shape
        keep = attention.numpy().astype(bool)
        worst = max(worst, float(np.abs(got[keep] - want[keep]).max()))
    assert worst < 1e-4
    print(f"ONNX: onnxruntime vs transformers max abs logit difference {worst:.3g}")
    assert AutoTokenizer.from_pretrained(onnx_dir).chat_template == tok.chat_template
    assert load_card(onnx_dir).data.ftcore["verification"]["onnxruntime max_abs_logit_diff"] < 1e-4


QLORA = """
[run]
name = "q"
seed = 3

[model]
use = "hf"
path = "base"

[quantizer]
use = "bnb-nf4"

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
max_steps = 6
batch_size = 8
max_length = 64
learning_rate = 1e-2

[[export]]
use = "merged"

[[export]]
use = "adapter"
"""


@pytest.mark.slow
def test_qlora_merged_export_merges_into_the_full_precision_base(tmp_path, tiny_llama):
    pytest.importorskip("bitsandbytes")
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ftcore_plugins.quantizers.bnb_nf4 import NF4Quantizer

    shutil.copytree(tiny_llama, tmp_path / "base")
    write_jsonl(tmp_path / "chat.jsonl", chat_rows(64))
    (tmp_path / "plan.toml").write_text(QLORA)
    result = run_cli("run", str(tmp_path / "plan.toml"))
    assert result.returncode == 0, result.stderr
    run = tmp_path / "runs" / "q"
    merged_dir = run / "exports" / "merged"

    # Full precision: no quantization config, no bitsandbytes tensors, every weight float32.
    config = json.loads((merged_dir / "config.json").read_text())
    assert "quantization_config" not in config
    with safe_open(merged_dir / "model.safetensors", "pt") as f:
        dtypes = {str(f.get_tensor(k).dtype) for k in f.keys()}
        assert not [k for k in f.keys() if "absmax" in k or "quant" in k]
    assert dtypes == {"torch.float32"}

    # The test's own reference: the exported adapter on the base loaded at full precision.
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    tok = AutoTokenizer.from_pretrained(merged_dir)
    prompts = [encode(tok, p) for p in PROMPTS]
    folded = [model_logits(merged, ids) for ids in prompts]
    full = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                                     run / "exports" / "adapter").eval()
    qlora_diff = max(max_diff(model_logits(full, ids), f) for ids, f in zip(prompts, folded))
    assert qlora_diff < 1e-4
    # Against the adapter on a 4-bit base, the difference is the quantization error: far larger.
    four_bit = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tmp_path / "base", **NF4Quantizer().load_kwargs()),
        run / "exports" / "adapter").eval()
    quantized_diff = max(max_diff(model_logits(four_bit, ids), f) for ids, f in zip(prompts, folded))
    assert quantized_diff > 100 * qlora_diff

    card = load_card(merged_dir)
    # The card says which base (by what the folder holds, no path of this machine) and how it was loaded.
    assert "| path | `a local folder, base` |" in card.text and "| architecture | `LlamaForCausalLM` |" in card.text
    assert "| quantizer.use | `bnb-nf4` |" in card.text and str(tmp_path) not in card.text
    recorded = card.data.ftcore["verification"]
    assert recorded["reference"] == "the trained adapter on the full-precision base"
    assert recorded["max_abs_logit_diff"] <= recorded["tolerance"] == 1e-4
    assert recorded["max_abs_logit_diff_vs_quantized_adapter"] > 100 * recorded["max_abs_logit_diff"]
    print(f"\nQLoRA merge: vs the adapter on the full-precision base {qlora_diff:.3g} (recorded "
          f"{recorded['max_abs_logit_diff']:.3g}); vs the adapter on the 4-bit base {quantized_diff:.3g} (recorded "
          f"{recorded['max_abs_logit_diff_vs_quantized_adapter']:.3g})")


ONE_LORA_STAGE = """
[[stage]]
trainer = "sft"
data = "chat"
adapter = { use = "%s", r = 4 }
max_steps = 1
batch_size = 4
max_length = 64

[[export]]
use = "merged"
"""


@pytest.mark.slow
def test_a_merge_outside_its_tolerance_exits_2_in_one_line_and_writes_nothing(tiny_project):
    # float32 rounding moves a merged model's logits a little (about 1e-7 here): never within 0.
    result = run_cli("run", str(tiny_project(ONE_LORA_STAGE % "lora" + "tolerance = 0\n")))
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "exporter 'merged'" in lines[0] and "above tolerance 0;" in lines[0], result.stderr
    assert not (tiny_project.dir / "runs" / "tiny" / "exports" / "merged").exists()


class BrokenMergeLora(LoraAdapter):
    """LoRA whose merge folds in twice the trained update: what the verification must catch."""

    name = "broken-merge-lora"

    def merge(self, model):
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.data.mul_(2)
        return model.merge_and_unload()


class BrokenMergePlugin:
    @ftcore.hookimpl
    def register_adapters(self, register):
        register(BrokenMergeLora)


@pytest.mark.slow
def test_a_wrong_merge_is_caught_by_the_verification(tiny_project):
    from rich.console import Console

    from ftcore.plan import load_plan
    from ftcore.plugins import PluginInfo, get_plugin_manager
    from ftcore.runner import Runner

    pm = get_plugin_manager(entry_points=False)
    pm.add_plugin(BrokenMergePlugin(), PluginInfo("broken", "ftcore-tests", "0", "entry point"))
    pm.check_pending()
    plan = load_plan(tiny_project(ONE_LORA_STAGE % "broken-merge-lora"), pm.registry())
    with pytest.raises(FtcoreError) as err, open(tiny_project.dir / "console.txt", "w") as out:
        Runner(plan, pm, Console(file=out, width=200)).run()
    message = str(err.value)
    assert "\n" not in message and message.startswith("exporter 'merged': the merged model's logits differ from "
                                                       "the trained adapter model's by up to ")
    assert float(message.split("by up to ")[1].split()[0]) > 1e-3  # the doubled update, far above 1e-4
    assert not (tiny_project.dir / "runs" / "tiny" / "exports" / "merged").exists()


def test_onnx_without_its_packages_fails_validation_naming_the_extra(tiny_project, monkeypatch):
    import importlib.util

    from ftcore.errors import PlanError
    from ftcore.plan import load_plan
    from ftcore.plugins import get_plugin_manager

    plan = tiny_project('[[stage]]\ntrainer = "sft"\ndata = "chat"\nadapter = "lora"\n\n[[export]]\nuse = "onnx"\n')
    registry = get_plugin_manager(entry_points=False).registry()
    real = importlib.util.find_spec
    # Simulates an environment without onnxruntime (installed here for the other tests).
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnxruntime" else real(name, *a))
    with pytest.raises(PlanError) as err:
        load_plan(plan, registry)
    assert [p for p in err.value.problems if p.endswith("export[0].use: exporter 'onnx' needs onnxruntime, which is "
                                                        "not installed: pip install 'ftcore[onnx]'")]
