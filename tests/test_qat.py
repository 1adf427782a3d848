"""Quantization-aware training (``qat`` on an ``sft`` stage, torchao) and the ``torchao`` export of its scheme.

Everything runs for real on a CPU, on the tiny local Llama: the fake-quantized layers torchao puts in while the
stage trains, the model handed on after it, and the export quantized to the same scheme, reloaded by plain
transformers.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

from conftest import chat_rows, run_cli, write_jsonl

pytest.importorskip("torch")
pytest.importorskip("torchao")

PLAN = """
[run]
name = "qat"
seed = 3

[model]
use = "hf"
path = "base"

[quantizer]
use = "{quantizer}"

[template]
use = "chatml"

[adapter]
{adapter}

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
learning_rate = {lr}
logging_steps = 1
qat = {qat}

[[export]]
use = "merged"

[[export]]
use = "torchao"
"""
FULL = 'use = "full"'
LORA = 'use = "lora"\nr = 8\nlora_alpha = 16'


def plan(adapter: str = FULL, qat: str = '{ weights = "int4", group_size = 32 }', quantizer: str = "none",
         lr: str = "1e-3") -> str:
    return PLAN.format(adapter=adapter, qat=qat, quantizer=quantizer, lr=lr)


class Lines:
    """The reporter ``fake_quantized`` is given: its info lines, kept."""

    def __init__(self):
        self.lines: list[str] = []

    def info(self, line: str) -> None:
        self.lines.append(line)


@pytest.fixture
def project(tmp_path, tiny_llama):
    shutil.copytree(tiny_llama, tmp_path / "base")
    write_jsonl(tmp_path / "chat.jsonl", chat_rows(64))
    return tmp_path


@pytest.mark.parametrize("body, expected", [
    (plan(quantizer="bnb-nf4", adapter=LORA), 'qat: trains full-precision weights for a quantization applied after '
                                              'training, and [quantizer] use = "bnb-nf4"'),
    (plan(qat="{ group_size = 48 }"), "qat: group_size 48 does not divide the model's hidden_size (64)"),
    (plan(qat='{ weights = "int3" }'), "qat.weights"),
])
def test_validate_refuses_what_qat_cannot_train(project, body, expected):
    (project / "plan.toml").write_text(body)
    result = run_cli("validate", "plan.toml", cwd=project)
    assert result.returncode == 2, result.stdout + result.stderr
    assert expected in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_peft_model_trains_fake_quantized_base_layers_and_gets_them_back(tiny_llama):
    """Inside the block the base layers (not the adapter's, not the head) compute with the scheme's weights,
    the same parameters throughout; after it, plain ``nn.Linear`` layers again."""
    import torch
    from peft import LoraConfig, get_peft_model
    from torchao.quantization import quantize_
    from transformers import AutoModelForCausalLM

    from ftcore_plugins.common.qat import QatOptions, base_config
    from ftcore_plugins.trainers._qat import fake_quantized

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama),
                           LoraConfig(r=4, target_modules="all-linear"))
    with torch.no_grad():  # a non-zero adapter, so that it shows in the outputs
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    params = {n: p for n, p in model.named_parameters()}
    ids = torch.tensor([[5, 17, 42, 99, 7, 3, 150, 60]])
    options = QatOptions(weights="int4", group_size=32)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    log = Lines()
    with fake_quantized(model, options, stage="sft", reporter=log) as n:
        kinds = {path: type(m).__name__ for path, m in model.named_modules()}
        with torch.no_grad():
            fake = model(input_ids=ids).logits
    assert n == 14  # 2 layers x (q, k, v, o, gate, up, down)
    assert sum(k == "FakeQuantizedLinear" for k in kinds.values()) == 14
    assert all(k != "FakeQuantizedLinear" for p, k in kinds.items() if "lora_" in p or p.endswith("lm_head"))
    assert "14 linear layers train fake-quantized to int4 weights in groups of 32" in log.lines[0]
    assert not any(type(m).__name__ == "FakeQuantizedLinear" for m in model.modules())
    assert all(p is params[n] for n, p in model.named_parameters())
    # What it computed: the base quantized for real (torchao's own PTQ of the scheme) plus the adapter.
    reference = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama),
                               LoraConfig(r=4, target_modules="all-linear"))
    reference.load_state_dict(model.state_dict())
    base = {id(m) for path, m in reference.named_modules() if type(m) is torch.nn.Linear and "lora_" not in path
            and not path.endswith("lm_head")}
    quantize_(reference, base_config(options), filter_fn=lambda m, _: id(m) in base)
    with torch.no_grad():
        real = reference(input_ids=ids).logits
    assert (fake - real).abs().max().item() < 1e-5
    assert (fake - plain).abs().max().item() > 1e-3


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_estimate_counts_what_fake_quantized_layers_keep_for_backward(tiny_llama, checkpointing):
    """The bytes a training forward saves for backward (saved-tensor hooks, unique storages), with and without
    ``qat``: the difference is what the estimate adds. With checkpointing: a layer recomputed in backward."""
    import torch
    from transformers import AutoModelForCausalLM

    from ftcore_plugins.common.qat import QatOptions
    from ftcore_plugins.trainers._qat import activation_bytes, fake_quantized

    def saved(model, qat):
        storages: dict[int, int] = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        ids = torch.tensor([[5, 17, 42, 99, 7, 3, 150, 60]])
        with fake_quantized(model, qat, stage="sft", reporter=Lines()):
            if checkpointing:  # the forward of one decoder layer, as backward recomputes it
                layer, hidden = model.model.layers[0], torch.randn(1, 8, 64, requires_grad=True)
                position = model.model.rotary_emb(hidden, torch.arange(8)[None])
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    layer(hidden, position_embeddings=position)
            else:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    model(input_ids=ids, labels=ids)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        return sum(n for ptr, n in storages.items() if ptr not in params)

    model = AutoModelForCausalLM.from_pretrained(tiny_llama).train()
    options = QatOptions(weights="int4", group_size=32)
    added = saved(model, options) - saved(model, None)
    assert added == activation_bytes(options, model, checkpointing), (added, activation_bytes(options, model,
                                                                                               checkpointing))
    assert activation_bytes(None, model, checkpointing) == 0


@pytest.mark.slow
def test_a_full_fine_tune_with_qat_exports_exactly_the_model_it_trained(project):
    """The torchao export (weights = "auto") quantizes to the stage's scheme; it equals the merged export
    fake-quantized as the stage trained it, and transformers reloads it."""
    import torch
    from torchao.quantization import IntxUnpackedToInt8Tensor, quantize_
    from torchao.quantization.qat import QATConfig
    from transformers import AutoModelForCausalLM

    from ftcore_plugins.common.qat import QatOptions, base_config

    (project / "plan.toml").write_text(plan())
    result = run_cli("run", "plan.toml", cwd=project)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run = project / "runs" / "qat"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    loss = [r["loss"] for r in rows if r.get("stage") == "sft" and "loss" in r]
    assert len(loss) == 8 and sum(loss[-3:]) / 3 < sum(loss[:3]) / 3 - 0.3, loss
    assert any(r.get("qat_layers") == 14 for r in rows)
    exports = run / "exports"
    merged = AutoModelForCausalLM.from_pretrained(exports / "merged").eval()
    assert "quantization_config" not in json.loads((exports / "merged" / "config.json").read_text())
    assert all(type(m) is torch.nn.Linear for n, m in merged.named_modules() if n.endswith("_proj"))
    quantized = AutoModelForCausalLM.from_pretrained(exports / "torchao").eval()
    assert isinstance(quantized.model.layers[0].mlp.down_proj.weight, IntxUnpackedToInt8Tensor)
    quantize_(merged, QATConfig(base_config(QatOptions(weights="int4", group_size=32)), step="prepare"),
              filter_fn=lambda m, path: isinstance(m, torch.nn.Linear) and not path.endswith("lm_head"))
    ids = torch.tensor([[5, 17, 42, 99, 7, 3, 150, 60]])
    with torch.no_grad():
        gap = (quantized(input_ids=ids).logits - merged(input_ids=ids).logits).abs().max().item()
    assert gap < 1e-5, gap
    error = next(r for r in rows if r.get("stage") == "export:torchao" and "quantization_error" in r)
    print(f"\nfull + qat int4/32: sft loss {loss[0]:.3f} -> {loss[-1]:.3f}; the export against the merged model "
          f"fake-quantized: {gap:.2g}; quantization error {error['quantization_error']:.3g}")  # RESULTS.md (-s)
    card = (exports / "torchao" / "README.md").read_text()
    assert "int4 weights in groups of 32, the scheme stage 'sft' trained for (QAT)" in card
    assert float(re.search(r"\| max_abs_logit_diff_reloaded \| ([0-9.e-]+) \|", card)[1]) == 0


@pytest.mark.slow
def test_lora_with_qat_and_int8_activations_trains_and_exports_its_scheme(project):
    from torchao.quantization import IntxUnpackedToInt8Tensor
    from transformers import AutoModelForCausalLM

    (project / "plan.toml").write_text(plan(LORA, '{ weights = "int4", group_size = 32, activations = "int8" }',
                                            lr="1e-2"))
    result = run_cli("run", "plan.toml", cwd=project)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run = project / "runs" / "qat"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    loss = [r["loss"] for r in rows if r.get("stage") == "sft" and "loss" in r]
    assert len(loss) == 8 and sum(loss[-3:]) / 3 < sum(loss[:3]) / 3 - 0.3, loss
    assert any(r.get("qat_layers") == 14 for r in rows)  # the base layers, not the adapter's
    export = next(r for r in rows if r.get("stage") == "export:torchao" and "quantization_error" in r)
    assert export["max_abs_logit_diff_reloaded"] == 0 and 0 < export["quantization_error"] < 1, export
    print(f"\nlora + qat int4/32, int8 activations: sft loss {loss[0]:.3f} -> {loss[-1]:.3f}; quantization error "
          f"{export['quantization_error']:.3g}")  # RESULTS.md (-s)
    quantized = AutoModelForCausalLM.from_pretrained(run / "exports" / "torchao")
    assert isinstance(quantized.model.layers[0].self_attn.q_proj.weight, IntxUnpackedToInt8Tensor)
    card = (run / "exports" / "torchao" / "README.md").read_text()
    assert "int8 dynamic activations, the scheme stage 'sft' trained for (QAT)" in card
