"""The bitsandbytes quantizers: QLoRA on a tiny local Llama (4-bit NF4 base with double
quantization, fp32 LoRA, a few SFT steps), FP4 and int8 loading and training, the saved
adapter on a freshly quantized base, and the plan checks that refuse what cannot work.

Everything runs for real on the CPU (bitsandbytes >= 0.48 has CPU kernels for 4-bit and
int8, forward and backward). The only mock is CUDA itself, for the multi-GPU ``device_map``
of ``load_kwargs()``, a CUDA-only path.
"""

from __future__ import annotations

import json
import shutil

import pytest

import ftcore
from ftcore.component import Component
from ftcore.errors import FtcoreError, PlanError

from conftest import chat_rows, run_cli, write_jsonl

PROBE = [[5, 17, 42, 99, 7, 3, 150, 60]]


@pytest.fixture
def project(tmp_path, tiny_llama):
    shutil.copytree(tiny_llama, tmp_path / "base")
    write_jsonl(tmp_path / "chat.jsonl", chat_rows(64))
    return tmp_path


# -- a test plugin that looks at the trained model from inside a real run -----------------------
SEEN: dict = {}


class InspectExporter(Component):
    """Records what the trained model is made of, and its logits on a fixed input."""

    name = "inspect"

    def export(self, ctx):
        import bitsandbytes as bnb
        import torch

        model = ctx.model
        base = model.get_base_model()
        quantized = {n: m for n, m in base.named_modules() if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))}
        SEEN.clear()
        SEEN["quantized"] = sorted(quantized)
        SEEN["types"] = {type(m).__name__ for m in quantized.values()}
        SEEN["weights"] = {n: weight_facts(m) for n, m in quantized.items()}
        SEEN["plain_linears"] = sorted(n for n, m in base.named_modules()
                                       if type(m) is torch.nn.Linear and "lora_" not in n)
        SEEN["trainable"] = {n: p.dtype for n, p in model.named_parameters() if p.requires_grad}
        SEEN["lora"] = {n: (p.dtype, p.requires_grad) for n, p in model.named_parameters() if "lora_" in n}
        SEEN["use_cache"] = base.config.use_cache
        SEEN["non_quantized"] = non_quantized(model)
        SEEN["moved_rows"] = sum(
            not torch.equal(m.trainable_tokens_delta["default"].to(m.base_layer.weight.dtype),
                            m.base_layer.weight[m.token_indices["default"]])
            for m in base.modules() if type(m).__name__ == "TrainableTokensLayer")
        SEEN["checkpointing"] = base.is_activation_checkpointing
        layer = base.model.layers[0]
        SEEN["checkpoint_kwargs"] = getattr(getattr(layer, "_gradient_checkpointing_func", None), "keywords", None)
        model.eval()
        with torch.no_grad():
            SEEN["logits"] = model(input_ids=torch.tensor(PROBE)).logits.float().clone()
        ctx.path.mkdir(parents=True)
        return ctx.path


def _unwrap(module):
    """The embedding or head under peft's trainable-tokens wrapper."""
    return getattr(getattr(module, "token_adapter", None), "base_layer", module)


def weight_facts(layer) -> dict:
    """What a quantized layer's weight is, as values (bitsandbytes mutates its quant_state in place)."""
    w = layer.weight
    state = getattr(w, "quant_state", None)
    # int8 row scales: on the weight until the first forward, then on the layer's state
    scb = getattr(w, "SCB", None)
    scb = scb if scb is not None else getattr(getattr(layer, "state", None), "SCB", None)
    return {"kind": type(w).__name__, "dtype": w.dtype, "quant_state": state is not None,
            "quant_type": getattr(state, "quant_type", None), "nested": getattr(state, "nested", None),
            "scb_dtype": None if scb is None else scb.dtype}


class InspectPlugin:
    @ftcore.hookimpl
    def register_exporters(self, register):
        register(InspectExporter)


def plugin_manager():
    from ftcore.plugins import PluginInfo, get_plugin_manager

    pm = get_plugin_manager(entry_points=False)
    pm.add_plugin(InspectPlugin(), PluginInfo("inspect", "ftcore-tests", "0", "entry point"))
    pm.check_pending()
    assert not pm.registry().problems
    return pm


def run_plan(folder, body: str):
    """Run a plan in this process (so the inspector sees the live model); return the run folder."""
    from rich.console import Console

    from ftcore.plan import load_plan
    from ftcore.runner import Runner

    path = folder / "plan.toml"
    path.write_text(body)
    pm = plugin_manager()
    plan = load_plan(path, pm.registry())
    with open(folder / "console.txt", "w") as out:
        summary = Runner(plan, pm, Console(file=out, width=200)).run()
    return folder / "runs" / "q", summary


def losses(run_dir) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r.get("stage") == "sft" and "loss" in r]


def plan_text(quantizer: str, steps: int, more: str = "") -> str:
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

[[stage]]
name = "sft"
trainer = "sft"
data = "chat"
max_steps = {steps}
batch_size = 8
max_length = 64
learning_rate = 1e-2
logging_steps = 1
save_steps = 1000

[[export]]
use = "inspect"
{more}
"""


def quantized_base(quantizer, folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, **quantizer.load_kwargs())


# -- QLoRA end to end --------------------------------------------------------------------------
@pytest.mark.slow
def test_qlora_nf4_trains_fp32_lora_on_a_4bit_base_and_the_adapter_reloads(project):
    bnb = pytest.importorskip("bitsandbytes")
    import torch
    from peft import PeftModel

    from ftcore_plugins.quantizers.bnb_nf4 import NF4Quantizer

    body = plan_text('use = "bnb-nf4"\nbnb_4bit_use_double_quant = true', steps=8, more="""
[[export]]
use = "adapter"

[[evaluate]]
use = "perplexity"
data = "chat"
max_length = 64
""")
    run, summary = run_plan(project, body)

    # It learned: the training loss fell, and so did the perplexity measured before and after.
    loss = losses(run)
    assert len(loss) == 8 and loss[-1] < loss[0] - 0.3, loss
    ev = summary["evaluations"]
    assert ev["after"]["perplexity"]["perplexity"] < 0.8 * ev["before"]["perplexity"]["perplexity"]

    # Every decoder linear is a bitsandbytes 4-bit layer: packed uint8 NF4 weights with a
    # double-quantized (nested) quant_state. The output head stays a plain fp32 Linear.
    assert SEEN["types"] == {"Linear4bit"} and len(SEEN["quantized"]) == 2 * 7
    for name, w in SEEN["weights"].items():
        assert w["kind"] == "Params4bit" and w["dtype"] == torch.uint8 and w["quant_state"], name
        assert w["quant_type"] == "nf4" and w["nested"] is True, name
    assert SEEN["plain_linears"] == ["lm_head"]

    # Only the LoRA matrices train, in fp32 (TRL casts them to bf16 for a quantized model;
    # the quantizer's preparation brings them back before the first step).
    assert SEEN["trainable"] and all("lora_" in n for n in SEEN["trainable"])
    assert set(SEEN["trainable"].values()) == {torch.float32}
    assert len(SEEN["lora"]) == 2 * 14 and set(SEEN["lora"].values()) == {(torch.float32, True)}
    # QLoRA preparation: non-reentrant gradient checkpointing, no KV cache in training.
    assert SEEN["checkpointing"] and SEEN["checkpoint_kwargs"] == {"use_reentrant": False}
    assert SEEN["use_cache"] is False

    # The saved adapter loads with peft onto a freshly quantized base and gives the trained
    # model's outputs; the bare base gives others.
    adapter = run / "exports" / "adapter"
    base = quantized_base(NF4Quantizer(), project / "base")
    probe = torch.tensor(PROBE)
    with torch.no_grad():
        bare = base(input_ids=probe).logits.float()
        loaded = PeftModel.from_pretrained(base, adapter).eval()
        assert isinstance(loaded.get_base_model().model.layers[0].mlp.up_proj.base_layer, bnb.nn.Linear4bit)
        again = loaded(input_ids=probe).logits.float()
    # atol: a model fresh from loading uses bitsandbytes' CPU inference kernel (bf16 inside), training does not
    assert torch.allclose(again, SEEN["logits"], atol=1e-2), (again - SEEN["logits"]).abs().max()
    assert (bare - SEEN["logits"]).abs().max() > 0.1


@pytest.mark.slow
@pytest.mark.parametrize("name, layer, weight, dtype", [
    ("bnb-fp4", "Linear4bit", "Params4bit", "uint8"),
    ("bnb-int8", "Linear8bitLt", "Int8Params", "int8"),
])
def test_fp4_and_int8_load_their_layer_types_and_train_on_cpu(project, name, layer, weight, dtype):
    pytest.importorskip("bitsandbytes")
    import torch

    run, _ = run_plan(project, plan_text(f'use = "{name}"', steps=6))
    loss = losses(run)
    assert len(loss) == 6 and loss[-1] < loss[0] - 0.3, loss
    assert SEEN["types"] == {layer} and len(SEEN["quantized"]) == 2 * 7
    for n, w in SEEN["weights"].items():
        assert w["kind"] == weight and w["dtype"] == getattr(torch, dtype), n
        if name == "bnb-fp4":
            assert w["quant_state"] and w["quant_type"] == "fp4" and w["nested"] is True, n  # double quant: default
        else:
            assert w["scb_dtype"] == torch.float32, n  # per-row int8 scales
    assert SEEN["trainable"] and set(SEEN["trainable"].values()) == {torch.float32}
    assert all("lora_" in n for n in SEEN["trainable"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bnb-nf4", "bnb-int8"])
def test_gradients_reach_every_adapter_even_after_an_evaluation(tiny_llama, name):
    """An evaluation (eval mode, no grad) before training must not change how gradients flow
    back through the frozen quantized layers: on an AVX512-BF16 CPU bitsandbytes would repack
    4-bit weights into an inference layout whose kernel has no backward, silently zeroing the
    gradients of every adapter below the last layer. Gradients must match a fresh model's, and
    a quantized model's must be close to the full-precision model's."""
    pytest.importorskip("bitsandbytes")
    import torch
    from peft import LoraConfig, get_peft_model

    from ftcore.plugins import get_plugin_manager

    registry = get_plugin_manager(entry_points=False).registry()

    def grads(quantizer_name, evaluate_first):
        from transformers import AutoModelForCausalLM

        quantizer = registry.resolve("quantizer", quantizer_name).cls()
        model = AutoModelForCausalLM.from_pretrained(tiny_llama, **quantizer.load_kwargs())
        model = quantizer.prepare(model)
        if quantizer_name == "none":
            for p in model.parameters():
                p.requires_grad_(False)
        torch.manual_seed(0)
        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=4, target_modules="all-linear"))
        probe = torch.tensor(PROBE)
        if evaluate_first:
            model.eval()
            with torch.no_grad():
                model(input_ids=probe)
        model.train()
        model(input_ids=probe, labels=probe).loss.backward()
        return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    fresh, evaluated, full = grads(name, False), grads(name, True), grads("none", False)
    first = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"
    assert fresh[first].abs().sum() > 0
    for n in fresh:
        assert evaluated[n] is not None and torch.allclose(evaluated[n], fresh[n], atol=1e-6), n
        assert (fresh[n] - full[n]).norm() <= 0.25 * full[n].norm(), n  # quantization error only


# -- fp32_non_quantized: what stays in fp32 ---------------------------------------------------------
def non_quantized(model) -> dict:
    """The dtypes of a model's non-quantized weights: norms, input embeddings, LM head."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    norms = {p.dtype for n, p in base.named_parameters() if "norm" in n}
    return {"norms": norms, "embeddings": _unwrap(base.get_input_embeddings()).weight.dtype,
            "head": _unwrap(base.get_output_embeddings()).weight.dtype}


@pytest.mark.slow
@pytest.mark.parametrize("fp32", [False, True])
def test_fp32_non_quantized_decides_the_dtype_of_norms_embeddings_and_head(tiny_llama, fp32):
    """A bf16 model loaded in 4 bits: with fp32_non_quantized = false its norms, embeddings and head stay
    bf16 (as TRL leaves them), with true they are upcast to fp32 (peft's prepare_model_for_kbit_training);
    either way the LoRA weights train in fp32, and the loss falls."""
    pytest.importorskip("bitsandbytes")
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from ftcore_plugins.quantizers.bnb_nf4 import NF4Quantizer

    quantizer = NF4Quantizer(NF4Quantizer.Options(fp32_non_quantized=fp32))
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16, **quantizer.load_kwargs())
    assert non_quantized(model) == {"norms": {torch.bfloat16}, "embeddings": torch.bfloat16, "head": torch.bfloat16}
    model = quantizer.prepare(model)
    want = torch.float32 if fp32 else torch.bfloat16
    assert non_quantized(model) == {"norms": {want}, "embeddings": want, "head": want}
    assert not any(p.requires_grad for p in model.parameters())
    assert model.is_activation_checkpointing and model.config.use_cache is False

    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=8, target_modules="all-linear"))
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    for p in lora:  # as TRL's trainers do to a quantized model's trainable weights
        p.data = p.data.to(torch.bfloat16)
    optimizer = torch.optim.AdamW(lora, lr=1e-2)
    probe = torch.tensor(PROBE * 4)
    model.train()
    losses = []
    for _ in range(6):
        loss = model(input_ids=probe, labels=probe).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    # keep_trainable_fp32 brought the adapter back to fp32 before the first step; the base kept its dtypes
    assert {p.dtype for p in lora} == {torch.float32} and all(p.requires_grad for p in lora)
    assert non_quantized(model) == {"norms": {want}, "embeddings": want, "head": want}
    assert losses[-1] < losses[0] - 0.5, losses


def test_fp32_non_quantized_defaults_to_the_devices():
    from ftcore_plugins.common.device_defaults import defaults
    from ftcore_plugins.quantizers.bnb_int8 import Int8Quantizer
    from ftcore_plugins.quantizers.bnb_nf4 import NF4Quantizer

    assert NF4Quantizer().keeps_fp32("cpu") is True and NF4Quantizer().keeps_fp32("cuda") is False
    assert defaults("cpu").fp32_non_quantized and not defaults("cuda").fp32_non_quantized
    for cls in (NF4Quantizer, Int8Quantizer):
        assert cls(cls.Options(fp32_non_quantized=True)).keeps_fp32("cuda") is True
        assert cls(cls.Options(fp32_non_quantized=False)).keeps_fp32("cpu") is False


@pytest.mark.slow
@pytest.mark.parametrize("fp32", [False, True])
def test_a_template_that_adds_tokens_trains_their_rows_either_way(project, fp32):
    """llama3 adds four special tokens to the tiny tokenizer: their embedding and head rows train (peft's
    trainable tokens, in fp32) on a bf16 4-bit base whether or not the base's other weights are upcast."""
    pytest.importorskip("bitsandbytes")
    import torch

    body = plan_text(f'use = "bnb-nf4"\nfp32_non_quantized = {str(fp32).lower()}', steps=6)
    body = body.replace('path = "base"', 'path = "base"\ndtype = "bfloat16"').replace('use = "chatml"', 'use = "llama3"')
    run, _ = run_plan(project, body)
    loss = losses(run)
    assert len(loss) == 6 and loss[-1] < loss[0] - 0.3, loss
    deltas = {n: d for n, d in SEEN["trainable"].items() if "trainable_tokens" in n}
    assert len(deltas) == 2 and set(deltas.values()) == {torch.float32}, SEEN["trainable"]  # embeddings and head
    assert SEEN["moved_rows"] == 2  # both moved away from the rows they started from
    want = torch.float32 if fp32 else torch.bfloat16
    assert SEEN["non_quantized"] == {"norms": {want}, "embeddings": want, "head": want}


# -- load_kwargs and prepare, without a run ----------------------------------------------------
def test_load_kwargs_carry_bitsandbytes_options():
    torch = pytest.importorskip("torch")
    from ftcore_plugins.quantizers.bnb_fp4 import FP4Quantizer
    from ftcore_plugins.quantizers.bnb_int8 import Int8Quantizer
    from ftcore_plugins.quantizers.bnb_nf4 import NF4Quantizer

    nf4 = NF4Quantizer().load_kwargs()
    assert set(nf4) == {"quantization_config"}
    config = nf4["quantization_config"]
    assert config.load_in_4bit and not config.load_in_8bit
    assert config.bnb_4bit_quant_type == "nf4" and config.bnb_4bit_use_double_quant
    assert config.bnb_4bit_quant_storage == torch.uint8
    if not torch.cuda.is_available():
        assert config.bnb_4bit_compute_dtype == torch.float32  # "auto" on a CPU

    fp4 = FP4Quantizer(FP4Quantizer.Options(bnb_4bit_use_double_quant=False, bnb_4bit_compute_dtype="bfloat16",
                                            bnb_4bit_quant_storage="bfloat16")).load_kwargs()["quantization_config"]
    assert fp4.bnb_4bit_quant_type == "fp4" and not fp4.bnb_4bit_use_double_quant
    assert fp4.bnb_4bit_compute_dtype == torch.bfloat16 and fp4.bnb_4bit_quant_storage == torch.bfloat16

    int8 = Int8Quantizer(Int8Quantizer.Options(llm_int8_threshold=4.0)).load_kwargs()["quantization_config"]
    assert int8.load_in_8bit and not int8.load_in_4bit and int8.llm_int8_threshold == 4.0


def test_under_torchrun_each_process_loads_onto_its_own_gpu(monkeypatch):
    """CUDA-only path, so CUDA is mocked: with WORLD_SIZE > 1 the whole model goes to LOCAL_RANK's GPU."""
    torch = pytest.importorskip("torch")
    from ftcore_plugins.quantizers.bnb_nf4 import NF4Quantizer

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    kwargs = NF4Quantizer().load_kwargs()
    assert kwargs["device_map"] == {"": 1}
    assert kwargs["quantization_config"].bnb_4bit_compute_dtype == torch.bfloat16  # "auto" on a bf16 GPU
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert "device_map" not in NF4Quantizer().load_kwargs()  # one process: transformers places it


def test_prepare_refuses_a_model_the_loader_did_not_quantize():
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    from ftcore_plugins.quantizers.bnb_int8 import Int8Quantizer
    from ftcore_plugins.quantizers.bnb_nf4 import NF4Quantizer

    config = AutoConfig.for_model("llama", vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=32)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for quantizer, bits in ((NF4Quantizer(), "4-bit"), (Int8Quantizer(), "8-bit")):
        with pytest.raises(FtcoreError, match=f"ignored the quantizer.*not loaded in {bits}") as err:
            quantizer.prepare(model)
        assert "\n" not in str(err.value)


def test_a_quantizer_that_quantizes_no_layer_is_refused(tmp_path):
    """Falcon's linear layers are its own FalconLinear, which transformers' bitsandbytes integration does not
    replace: the model comes back marked 4-bit with every weight at full precision. The stage would train a
    plain LoRA under QLoRA's name; the quantizer refuses it in one line naming the family."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    from ftcore_plugins.quantizers.bnb_nf4 import NF4Quantizer

    config = AutoConfig.for_model("falcon", vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    quantizer = NF4Quantizer()
    model = AutoModelForCausalLM.from_pretrained(tmp_path, **quantizer.load_kwargs())
    assert model.is_loaded_in_4bit  # transformers' flag says 4-bit all the same
    with pytest.raises(FtcoreError, match=r"^quantizer 'bnb-nf4': bitsandbytes quantized no layer of this falcon "
                                          r"model \(its linear layers are FalconLinear,") as err:
        quantizer.prepare(model)
    assert "\n" not in str(err.value)


# -- plan validation ---------------------------------------------------------------------------
VALID = """
[model]
use = "hf"
path = "some-org/some-model"

[quantizer]
use = "bnb-nf4"

[adapter]
use = "lora"

[data.chat]
use = "jsonl"
path = "chat.jsonl"

[[stage]]
trainer = "sft"
data = "chat"

[[export]]
use = "adapter"
"""

SCRATCH = """
[model]
use = "scratch"
tokenizer_data = ["chat"]

[quantizer]
use = "bnb-nf4"

[adapter]
use = "lora"

[data.chat]
use = "jsonl"
path = "chat.jsonl"

[[stage]]
trainer = "sft"
data = "chat"
"""


def plan_errors(tmp_path, text: str) -> list[str]:
    from ftcore.plan import load_plan
    from ftcore.plugins import get_plugin_manager

    write_jsonl(tmp_path / "chat.jsonl", chat_rows(4))
    path = tmp_path / "plan.toml"
    path.write_text(text)
    try:
        load_plan(path, get_plugin_manager(entry_points=False).registry())
    except PlanError as exc:
        assert all(p.startswith(f"{path}: ") for p in exc.problems), exc.problems
        return [p[len(f"{path}: "):] for p in exc.problems]  # "<key path>: <message>"
    return []


def test_a_quantized_lora_plan_is_valid(tmp_path):
    assert plan_errors(tmp_path, VALID) == []
    # A merged export merges into the base loaded again at full precision (tests/test_exporters.py).
    assert plan_errors(tmp_path, VALID.replace('use = "adapter"', 'use = "merged"')) == []
    for name in ("bnb-fp4", "bnb-int8"):
        assert plan_errors(tmp_path, VALID.replace('"bnb-nf4"', f'"{name}"')) == []


@pytest.mark.parametrize("case, text, expected", [
    ("scratch model", SCRATCH,
     r"^quantizer: quantizer 'bnb-nf4' cannot quantize \[model\] use = \"scratch\": it builds a randomly "
     r"initialised model.*use = \"hf\""),
    ("full fine-tuning (the default adapter)", VALID.replace('[adapter]\nuse = "lora"\n', "").replace(
        '[[export]]\nuse = "adapter"\n', ""),
     r"^quantizer: stage '0-sft' uses adapter 'full', which trains the base weights; 4-bit weights cannot be "
     r"trained.*adapter = \"lora\""),
    ("an adapter change between stages", VALID + '\n[[stage]]\ntrainer = "sft"\ndata = "chat"\n'
                                                  'adapter = { use = "lora", r = 16 }\n',
     r"^quantizer: stage '1-sft' changes the adapter, which would merge the previous one into the 4-bit base"),
    ("int8 with full fine-tuning", VALID.replace('"bnb-nf4"', '"bnb-int8"').replace('use = "lora"', 'use = "full"')
     .replace('[[export]]\nuse = "adapter"\n', ""),
     r"^quantizer: stage '0-sft' uses adapter 'full'.*8-bit weights cannot be trained"),
    ("a misspelled option", VALID.replace('use = "bnb-nf4"', 'use = "bnb-nf4"\nbnb_4bit_use_dobule_quant = false'),
     r"^quantizer\.bnb_4bit_use_dobule_quant: unknown key for quantizer 'bnb-nf4'.*bnb_4bit_use_double_quant"),
    ("a 4-bit option on int8",
     VALID.replace('use = "bnb-nf4"', 'use = "bnb-int8"\nbnb_4bit_compute_dtype = "bfloat16"'),
     r"^quantizer\.bnb_4bit_compute_dtype: unknown key for quantizer 'bnb-int8'"),
    ("a bad compute dtype", VALID.replace('use = "bnb-nf4"', 'use = "bnb-nf4"\nbnb_4bit_compute_dtype = "float8"'),
     r"^quantizer\.bnb_4bit_compute_dtype: .*'auto', 'float32', 'bfloat16' or 'float16'"),
])
def test_unsupported_combinations_fail_validation_in_one_line_under_quantizer(tmp_path, case, text, expected):
    import re

    problems = plan_errors(tmp_path, text)
    matching = [p for p in problems if re.search(expected, p)]
    assert len(matching) == 1, (case, problems)
    assert matching[0].startswith("quantizer") and "\n" not in matching[0]


def test_validate_command_reports_it_before_loading_anything(tmp_path):
    write_jsonl(tmp_path / "chat.jsonl", chat_rows(4))
    (tmp_path / "plan.toml").write_text(SCRATCH)
    result = run_cli("validate", "plan.toml", cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in (result.stdout + result.stderr).splitlines() if "bnb-nf4" in line]
    assert len(lines) == 1 and "quantizer: quantizer 'bnb-nf4' cannot quantize" in lines[0], lines
