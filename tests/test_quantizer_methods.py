"""The quantizers beyond bitsandbytes: ``hqq``, ``torchao``, ``quanto`` and ``fp8``.

Everything that runs on a CPU runs for real: HQQ (4-bit, and 2-bit on axis 0), torchao's int8 weight-only and
Quanto's int8 and int4 quantize a tiny local Llama, peft trains LoRA on top through a two-stage plan (SFT, then
DPO), and the merged export is reloaded in plain transformers. torchao's int4/float8 and ``fp8`` need a CUDA
GPU: their refusal by ``validate`` on this machine is tested, the CUDA path itself is unmeasured.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

from conftest import chat_rows, run_cli, write_jsonl
from test_evaluators import preference_rows

pytest.importorskip("torch")

# Every quantizer that runs on a CPU, as a plan's [quantizer] table, and the peft LoRA layer that wraps it.
ON_CPU = {
    "hqq-4bit": ('use = "hqq"', "HqqLoraLinear"),
    "hqq-2bit-axis0": ('use = "hqq"\nnbits = 2\ngroup_size = 32\naxis = 0', "HqqLoraLinear"),
    "torchao-int8": ('use = "torchao"', "TorchaoLoraLinear"),
    "quanto-int8": ('use = "quanto"', "Linear"),
    "quanto-int4": ('use = "quanto"\nweights = "int4"', "Linear"),
}
PACKAGES = {"hqq": "hqq", "torchao": "torchao", "quanto": "optimum.quanto"}


def needs(case: str) -> None:
    pytest.importorskip(PACKAGES[case.split("-")[0]])


def two_stage_plan(quantizer: str) -> str:
    return f"""
[run]
name = "q"
seed = 3

[model]
use = "hf"
path = "base"

[quantizer]
{quantizer}

[template]
use = "chatml"

[adapter]
use = "lora"
r = 8
lora_alpha = 16

[data.chat]
use = "jsonl"
path = "chat.jsonl"

[data.pairs]
use = "jsonl"
path = "pairs.jsonl"

[[stage]]
name = "sft"
trainer = "sft"
data = "chat"
max_steps = 10
batch_size = 8
max_length = 64
learning_rate = 1e-2
logging_steps = 1

[[stage]]
name = "dpo"
trainer = "dpo"
data = "pairs"
max_steps = 6
batch_size = 8
max_length = 64
learning_rate = 5e-3
logging_steps = 1

[[export]]
use = "merged"
"""


@pytest.fixture
def project(tmp_path, tiny_llama):
    shutil.copytree(tiny_llama, tmp_path / "base")
    write_jsonl(tmp_path / "chat.jsonl", chat_rows(64))
    write_jsonl(tmp_path / "pairs.jsonl", preference_rows(64))
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize("case", list(ON_CPU))
def test_a_two_stage_plan_trains_on_each_cpu_quantizer_and_the_merged_export_loads(project, case):
    needs(case)
    import torch
    from transformers import AutoModelForCausalLM

    (project / "plan.toml").write_text(two_stage_plan(ON_CPU[case][0]))
    result = run_cli("run", "plan.toml", cwd=project)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run = project / "runs" / "q"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    sft = [r["loss"] for r in rows if r.get("stage") == "sft" and "loss" in r]
    dpo = [r["loss"] for r in rows if r.get("stage") == "dpo" and "loss" in r]
    assert len(sft) == 10 and sum(sft[-3:]) / 3 < sum(sft[:3]) / 3 - 0.3, sft
    assert len(dpo) == 6 and dpo[0] == pytest.approx(0.6931, abs=1e-3) and dpo[-1] < 0.67, dpo
    log = (run / "run.log").read_text()
    assert re.search(rf"quantizer '{case.split('-')[0]}': \d+ layers hold \d-bit weights", log), log[-2000:]

    # Merged into the base loaded again at full precision; the quantization error is measured and stated.
    merged = run / "exports" / "merged"
    export = next(r for r in rows if r.get("stage") == "export:merged")
    assert export["max_abs_logit_diff"] <= export["tolerance"] == 1e-4
    error = export["max_abs_logit_diff_vs_quantized_adapter"]
    assert 1e-4 < error < 5, export  # the quantized model the run trained differs from the merge by its rounding
    print(f"\n{case}: sft loss {sft[0]:.3f} -> {sft[-1]:.3f}, dpo loss {dpo[0]:.4f} -> {dpo[-1]:.4f}, merge "
          f"{export['max_abs_logit_diff']:.2g}, quantization error {error:.3g}")  # RESULTS.md's table (-s)
    card = (merged / "README.md").read_text()
    assert f"| max_abs_logit_diff_vs_quantized_adapter | {error:.4g} |" in card
    config = json.loads((merged / "config.json").read_text())
    assert "quantization_config" not in config
    model = AutoModelForCausalLM.from_pretrained(merged)
    assert all(type(m) is torch.nn.Linear for n, m in model.named_modules() if n.endswith("_proj"))
    reference = AutoModelForCausalLM.from_pretrained(project / "base")
    assert not torch.equal(model.model.layers[0].mlp.down_proj.weight, reference.model.layers[0].mlp.down_proj.weight)


@pytest.mark.slow
def test_the_torchao_export_reloads_quantized_in_transformers_and_states_its_error(project):
    """A LoRA run's ``torchao`` export beside its ``merged`` one: int8 weights that transformers reloads as they
    were saved, whose logits differ from the merged model's by the quantization error the card states."""
    pytest.importorskip("torchao")
    import torch
    from torchao.quantization import Int8Tensor
    from transformers import AutoModelForCausalLM

    body = two_stage_plan('use = "none"').replace('[[export]]\nuse = "merged"\n',
                                                  '[[export]]\nuse = "merged"\n\n[[export]]\nuse = "torchao"\n')
    (project / "plan.toml").write_text(body.replace("max_steps = 10", "max_steps = 4").replace("max_steps = 6",
                                                                                             "max_steps = 2"))
    result = run_cli("run", "plan.toml", cwd=project)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    exports = project / "runs" / "q" / "exports"
    config = json.loads((exports / "torchao" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "torchao"
    quantized = AutoModelForCausalLM.from_pretrained(exports / "torchao").eval()
    merged = AutoModelForCausalLM.from_pretrained(exports / "merged").eval()
    assert isinstance(quantized.model.layers[0].mlp.down_proj.weight, Int8Tensor)
    ids = torch.tensor([[5, 17, 42, 99, 7, 3, 150, 60]])
    with torch.no_grad():
        error = (quantized(input_ids=ids).logits - merged(input_ids=ids).logits).abs().max().item()
    assert 1e-5 < error < 0.5, error
    card = (exports / "torchao" / "README.md").read_text()
    stated = float(re.search(r"\| max_abs_logit_diff_vs_merged \(quantization error\) \| ([0-9.e-]+) \|", card)[1])
    reloaded = float(re.search(r"\| max_abs_logit_diff_reloaded \| ([0-9.e-]+) \|", card)[1])
    assert reloaded == 0 and 1e-5 < stated < 0.5, card
    files = sorted(p.name for p in (exports / "torchao").iterdir())
    assert "model.safetensors" in files and not any(p.startswith(".torchao-") for p in files)
    assert not any(p.name.startswith(".torchao-") for p in exports.iterdir())


@pytest.mark.parametrize("case", list(ON_CPU))
def test_each_quantizer_trains_lora_through_its_own_layer_and_the_estimate_counts_its_bytes(tiny_llama, case):
    """In-process: the quantized layers are the library's, peft wraps them in its matching LoRA layer, the
    adapter alone trains (fp32) and gets gradients, and ``weight_bytes`` equals the bytes the layers hold."""
    needs(case)
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from ftcore.plugins import get_plugin_manager
    from ftcore_plugins.common.estimate import meta_model_from_config

    text, lora_layer = ON_CPU[case]
    options = dict(line.split(" = ") for line in text.splitlines())
    name = json.loads(options.pop("use"))
    cls = get_plugin_manager(entry_points=False).registry().resolve("quantizer", name).cls
    quantizer = cls(cls.Options(**{k: json.loads(v) for k, v in options.items()}))
    model = quantizer.prepare(AutoModelForCausalLM.from_pretrained(tiny_llama, **quantizer.load_kwargs()))
    quantized = quantizer.quantized_modules(model)
    assert len(quantized) == 14 and "lm_head" not in quantized  # 7 projections in each of 2 layers

    # The estimate's bytes for the quantized model, from the meta model, against the bytes it really holds.
    meta = meta_model_from_config(model.config, torch.float32)
    estimated = quantizer.weight_bytes(quantizer.prepare_meta(meta))
    held = sum(tensor_bytes(t) for m in model.modules()
               for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)])
    if name == "hqq":  # HQQLinear keeps its scales and zero points outside parameters (W_q is one)
        held += sum(tensor_bytes(m.meta["scale"]) + tensor_bytes(m.meta["zero"])
                    for m in model.modules() if type(m).__name__ == "HQQLinear")
    assert abs(estimated - held) <= 0.01 * held, (estimated, held)

    peft = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    wrapped = peft.base_model.model.model.layers[0].self_attn.q_proj
    assert type(wrapped).__name__ == lora_layer
    assert {n for n, p in peft.named_parameters() if p.requires_grad} == {
        n for n, p in peft.named_parameters() if "lora_" in n}
    peft.train()
    ids = torch.tensor([[5, 17, 42, 99, 7, 3, 150, 60]])
    peft(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in peft.named_parameters() if "lora_B" in n}
    assert len(grads) == 6 and all(g is not None and g.abs().sum() > 0 for g in grads.values())
    assert {p.dtype for n, p in peft.named_parameters() if "lora_" in n} == {torch.float32}


def tensor_bytes(t) -> int:
    """Bytes of a tensor, through a tensor subclass's inner tensors (torchao's and Quanto's weights)."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


# -- what validate refuses, in one line, before anything loads ---------------------------------------------------
VALID = two_stage_plan('use = "hqq"')


@pytest.mark.parametrize("case,quantizer,expected", [
    ("torchao int4 without a GPU", 'use = "torchao"\nweights = "int4"',
     r"^quantizer: quantizer 'torchao': weights = \"int4\": torchao's int4 weight-only layouts run on CUDA only "
     r".*\"Requires mslk >= 1\.0\.0\".*use weights = \"int8\" on this machine$"),
    ("torchao float8 without a GPU", 'use = "torchao"\nweights = "float8"',
     r"^quantizer: quantizer 'torchao': weights = \"float8\": .*compute capability 8\.9"),
    ("fp8 without a GPU", 'use = "fp8"',
     r"^quantizer: quantizer 'fp8' needs a CUDA GPU: transformers says \"No GPU or XPU found\. A GPU or XPU is "
     r"needed for FP8 quantization\.\"$"),
    ("hqq with full fine-tuning", 'use = "hqq"\n\n[adapter]\nuse = "full"',
     r"^quantizer: stage 'sft' uses adapter 'full', which trains the base weights; 4-bit weights cannot be trained"),
    ("quanto int2 with a changed adapter", 'use = "quanto"\nweights = "int2"', None),
    ("an hqq bit width it lacks", 'use = "hqq"\nnbits = 5', r"^quantizer\.nbits: .*1, 2, 3, 4 or 8"),
    ("a quanto type it lacks", 'use = "quanto"\nweights = "fp4"', r"^quantizer\.weights: .*'int8', 'int4' or 'int2'"),
])
def test_validate_refuses_what_cannot_run_in_one_line(tmp_path, tiny_llama, case, quantizer, expected):
    if case.endswith("without a GPU"):
        from ftcore_plugins.common.memory import gpu_visible

        if gpu_visible():
            pytest.skip("this machine has a GPU")
    body = VALID.replace('[quantizer]\nuse = "hqq"', f"[quantizer]\n{quantizer}")
    if "full" in quantizer:
        body = body.replace('[adapter]\nuse = "lora"\nr = 8\nlora_alpha = 16\n', "")
    if expected is None:  # DPO with another rank than SFT's: merging into 2-bit weights is refused
        body = body.replace('trainer = "dpo"', 'trainer = "dpo"\nadapter = { use = "lora", r = 4 }')
        expected = r"^quantizer: stage 'dpo' changes the adapter, which would merge the previous one into the 2-bit"
    shutil.copytree(tiny_llama, tmp_path / "base")
    write_jsonl(tmp_path / "chat.jsonl", chat_rows(4))
    write_jsonl(tmp_path / "pairs.jsonl", preference_rows(4))
    (tmp_path / "plan.toml").write_text(body)
    result = run_cli("validate", "plan.toml", cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("plan.toml:") or "quantizer" in line]
    matching = [line for line in result.stderr.splitlines() if re.search(expected, line.split(": ", 1)[-1])]
    assert len(matching) == 1, (case, lines)


def test_a_missing_library_is_named_with_its_pip_line(tmp_path, monkeypatch):
    """The quantizer's library is looked up, not imported, at validate: a missing one is one line naming it."""
    from ftcore_plugins.quantizers import _base

    real = _base.importlib.util.find_spec
    monkeypatch.setattr(_base.importlib.util, "find_spec", lambda name: None if name == "hqq" else real(name))
    from ftcore_plugins.quantizers.hqq import HqqQuantizer

    problems = [p for p in HqqQuantizer(HqqQuantizer.Options()).check(_FakePlan()) if "package" in p]
    assert problems == ["quantizer 'hqq' needs the hqq package: pip install 'hqq>=0.2.8'"]


class _FakePlan:
    """Only what WeightQuantizer.check reads: the model loader's name and no stages."""

    class model:
        name = "hf"

    stages: list = []
