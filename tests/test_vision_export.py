"""Exporting a vision-language model (issue #31): gguf and onnx, which write the language model alone, refuse
a VLM in one line at validation (exit 2, without importing torch), or when the export runs where the plan
could not tell (a hub id)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_cli
from test_vision_labels import FAMILIES, TOKENIZERS, built

pytestmark = pytest.mark.skipif(not TOKENIZERS.is_dir(), reason="../shared/fixtures/tokenizers is absent")

WHY = {"gguf": "llama.cpp runs one from two files, the language model and its vision tower and projector (mmproj), "
               "and this exporter writes the language model only",
       "onnx": "its graph takes input_ids and attention_mask, no pixels, so it would hold the language model alone"}


def vlm_plan(folder: Path, model: str, exporter: str) -> Path:
    """A plan that trains a tiny LLaVA (the scratch loader's, or a saved folder the hf loader reads) and exports it."""
    (folder / "train.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                                                 {"role": "assistant", "content": "Hello."}]}) + "\n")
    if model == "scratch":
        section = f'use = "scratch"\narchitecture = "llava"\nhidden_size = 32\nnum_layers = 2\nnum_heads = 2\n' \
                  f'tokenizer = "{TOKENIZERS / FAMILIES["llava"][0]}"'
    else:
        vlm, processor = built("llava")
        vlm.save_pretrained(folder / "vlm")
        processor.save_pretrained(folder / "vlm")
        section = f'use = "hf"\npath = "{folder / "vlm"}"'
    plan = folder / "plan.toml"
    plan.write_text(f'[model]\n{section}\n\n[template]\nuse = "native"\n\n[data.train]\nuse = "jsonl"\n'
                    f'path = "train.jsonl"\n\n[[stage]]\nname = "sft"\ntrainer = "sft"\ndata = "train"\nmax_steps = 1\n\n'
                    f'[[export]]\nuse = "{exporter}"\n')
    return plan


@pytest.mark.parametrize("model", ["scratch", "hf"])
@pytest.mark.parametrize("exporter", ["gguf", "onnx"])
def test_gguf_and_onnx_refuse_a_vlm_at_validation(tmp_path, exporter, model):
    """One stderr line naming the exporter and why, exit 2; found from the plan (the scratch architecture, or
    the folder's config.json) without importing torch or transformers. merged takes the same plan."""
    plan = vlm_plan(tmp_path, model, exporter)
    done = run_cli("validate", plan.name, cwd=tmp_path, env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert done.returncode == 2, done.stderr[-2000:]
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
    assert imported and "torch" not in imported and "transformers" not in imported
    lines = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("import time:")]
    assert lines == [f"plan.toml: export[0].use: exporter '{exporter}' does not export a vision-language model "
                     f"(llava): {WHY[exporter]}; export it with \"merged\" or \"adapter\" (docs/vision.md)"], lines
    plan.write_text(plan.read_text().replace(f'use = "{exporter}"', 'use = "merged"'))
    done = run_cli("validate", str(plan), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("exporter", ["gguf", "onnx"])
def test_gguf_and_onnx_refuse_a_vlm_the_plan_did_not_show(exporter):
    """A hub id tells nothing at validation: the loaded model is refused when the export runs, in one line."""
    from types import SimpleNamespace

    from ftcore.errors import FtcoreError
    from ftcore_plugins.exporters.gguf import GgufExporter
    from ftcore_plugins.exporters.onnx import OnnxExporter

    cls = {"gguf": GgufExporter, "onnx": OnnxExporter}[exporter]
    model, _ = built("llava")
    with pytest.raises(FtcoreError) as info:
        cls(cls.Options()).export(SimpleNamespace(name=exporter, model=model))
    assert str(info.value) == f"export '{exporter}': exporter '{exporter}' does not export a vision-language model " \
        f"(llava): {WHY[exporter]}; export it with \"merged\" or \"adapter\" (docs/vision.md)"


def test_a_text_model_is_not_taken_for_a_vlm(tmp_path, qwen25_tiny_model):
    """The check can fail: a text model's folder (no vision_config) passes it."""
    from types import SimpleNamespace

    from ftcore_plugins.exporters._vision import plan_vision_model

    def plan(name, **options):
        return SimpleNamespace(model=SimpleNamespace(name=name, options=SimpleNamespace(**options)))

    assert plan_vision_model(plan("hf", path=str(qwen25_tiny_model))) is None
    assert plan_vision_model(plan("scratch", architecture="llama")) is None
    assert plan_vision_model(plan("hf", path="Qwen/Qwen2.5-VL-3B-Instruct")) is None  # a hub id: known at export
    assert plan_vision_model(plan("scratch", architecture="gemma3")) == "gemma3"


def test_every_scratch_vlm_is_told_from_the_plan():
    """plugins/common/vlm.py's list (read without loading anything) is the scratch loader's VLM families."""
    from ftcore_plugins.common.vlm import VLM_ARCHITECTURES
    from ftcore_plugins.models._vlm import FAMILIES as BUILT

    assert sorted(VLM_ARCHITECTURES) == sorted(BUILT)


def test_the_adapter_export_holds_the_processor_and_generates_on_its_base(tmp_path):
    """A LLaVA LoRA run exported as `adapter`: peft's PeftModel on the recorded base and AutoProcessor from the
    export folder generate from an image in plain transformers, the adapter changing the base's output;
    the card shows how."""
    import torch
    from peft import PeftModel
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from test_vision_sft import write_data, write_plan

    write_data(tmp_path)
    plan = write_plan(tmp_path, "llava", '\n[[export]]\nuse = "adapter"\n')
    plan.write_text(plan.read_text().replace("max_steps = 6", "max_steps = 2"))
    done = run_cli("run", str(plan), cwd=tmp_path, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    export = tmp_path / "runs" / "plan" / "exports" / "adapter"
    base_path = json.loads((export / "adapter_config.json").read_text())["base_model_name_or_path"]
    base = AutoModelForImageTextToText.from_pretrained(base_path)
    processor = AutoProcessor.from_pretrained(export)
    assert type(processor).__name__ == "LlavaProcessor" and processor.chat_template
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is this square?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=[text], images=[[Image.open(tmp_path / "data" / "red.png")]], add_special_tokens=False,
                       return_tensors="pt")
    assert (inputs["input_ids"] == base.config.image_token_id).sum() > 1  # the image expanded into its tokens
    with torch.no_grad():
        plain = base(**inputs).logits
    model = PeftModel.from_pretrained(base, export)
    with torch.no_grad():
        adapted = model(**inputs).logits
    assert (adapted - plain).abs().max() > 1e-3  # the trained adapter is what runs
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > inputs["input_ids"].shape[1]
    card = (export / "README.md").read_text()
    assert "AutoModelForImageTextToText" in card and "AutoProcessor.from_pretrained" in card
