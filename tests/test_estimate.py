"""``ftcore estimate``: memory predicted from a plan without loading weights, checked against
the seed design's 7B figures and against peaks that real ``ftcore run``s measure on this CPU.

The run-based comparisons use the configurations of ``benchmarks/memory_estimate.py`` (which
prints the same table): tiny and ~55M-parameter Llama models, full fine-tuning and LoRA, with
and without gradient checkpointing, and QLoRA (bnb-nf4) on a local checkpoint.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import ROOT, computed_once, run_cli

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="measures memory through /proc")

GiB = 2**30
GB = 10**9


def _bench():
    spec = importlib.util.spec_from_file_location("memory_estimate", ROOT / "benchmarks" / "memory_estimate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["memory_estimate"] = module
    spec.loader.exec_module(module)
    return module


bench = _bench()


# -- the core stays light ---------------------------------------------------------------------
def test_the_estimate_command_imports_neither_torch_nor_a_component():
    # It asks components through their optional methods; importing it (as `ftcore --help` does) is light.
    code = "import sys, ftcore_plugins.commands.estimate; print(sorted(m for m in sys.modules if " \
           "m.split('.')[0] in ('torch', 'transformers') or m.startswith('ftcore_plugins.') and " \
           "m.split('.')[1] not in ('commands',)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_parse_size():
    from ftcore_plugins.commands.estimate import parse_size

    assert parse_size("16GB") == parse_size("16 GiB") == parse_size("16g") == parse_size("16") == 16 * GiB
    assert parse_size("800MB") == 800 * 2**20
    assert parse_size("1.5T") == int(1.5 * 2**40)
    with pytest.raises(ValueError):
        parse_size("lots")


# -- bad input --------------------------------------------------------------------------------
def test_a_bad_plan_exits_2_with_one_line(tiny_project):
    plan = tiny_project("""
[[stage]]
trainer = "sftt"
data = "chat"
""")
    result = run_cli("estimate", str(plan))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "stage[0]" in lines[0] and "did you mean 'sft'" in lines[0]
    assert result.stdout == ""


def test_a_bad_budget_exits_2(tiny_project):
    plan = tiny_project('[[stage]]\ntrainer = "sft"\ndata = "chat"\n')
    result = run_cli("estimate", str(plan), "--budget", "lots")
    assert result.returncode == 2
    assert result.stderr.strip() == "error: --budget: not a memory size: 'lots' (e.g. 16GB, 800MB)"


def test_a_hub_id_that_is_not_cached_is_not_downloaded(tmp_path):
    (tmp_path / "chat.jsonl").write_text("")
    plan = tmp_path / "hub.toml"
    plan.write_text('[model]\nuse = "hf"\npath = "nobody-ftcore/not-a-model"\n\n[data.chat]\nuse = "jsonl"\n'
                    'path = "chat.jsonl"\n\n[[stage]]\ntrainer = "sft"\ndata = "chat"\n')
    result = run_cli("estimate", str(plan), env={"HF_HOME": str(tmp_path / "empty-hf-home")}, timeout=3600)
    assert result.returncode == 2, result.stderr
    assert "estimate never downloads" in result.stderr and len(result.stderr.strip().splitlines()) == 1


# -- output -----------------------------------------------------------------------------------
TWO_STAGES = """
[[stage]]
name = "pre"
trainer = "pretrain"
data = "text"
adapter = "full"
batch_size = 4
max_length = 64

[[stage]]
name = "tune"
trainer = "sft"
data = "chat"
adapter = { use = "lora", r = 4 }
batch_size = 2
max_length = 64
gradient_checkpointing = true
"""


def test_one_line_per_stage_and_a_table(tiny_project):
    plan = tiny_project(TWO_STAGES)
    result = run_cli("estimate", str(plan), "--budget", "64GB", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    stage_lines = [line for line in lines if line.startswith("stage ")]
    assert [line.split(":")[0] for line in stage_lines] == ["stage pre", "stage tune"]
    assert "batch 4 x 64 tokens, checkpointing off" in stage_lines[0] and "full" in stage_lines[0]
    assert "lora (r=4)" in stage_lines[1] and "checkpointing on" in stage_lines[1]
    assert all("fits 64.00 GiB" in line for line in stage_lines)
    assert "Estimated peak memory (RSS, cpu), GiB" in result.stdout
    assert any("weights" in line and "activations" in line and "overhead" in line for line in lines)
    assert "note: stages run in one process" in result.stdout


def test_json_shape(tiny_project):
    plan = tiny_project(TWO_STAGES)
    result = run_cli("estimate", str(plan), "--json", "--device", "cpu", "--budget", "100MB")
    assert result.returncode == 1, result.stderr  # it does not fit in 100 MiB
    out = json.loads(result.stdout)
    assert {"plan", "model", "quantizer", "device", "budget_bytes", "peak_bytes", "peak_mib", "fits", "stages",
            "notes"} <= set(out)
    assert out["device"] == "cpu" and out["model"] == "scratch" and out["quantizer"] == "none"
    assert out["budget_bytes"] == 100 * 2**20 and out["fits"] is False
    pre, tune = out["stages"]
    assert (pre["stage"], pre["trainer"], pre["adapter"]) == ("pre", "pretrain", "full")
    assert (tune["batch_size"], tune["seq_len"], tune["gradient_checkpointing"]) == (2, 64, True)
    assert tune["optimizer"] == "adamw_torch" and tune["precision"] == "fp32"
    for s in out["stages"]:
        terms = s["bytes"]
        assert set(terms) == {"weights", "gradients", "optimizer", "activations", "overhead", "total"}
        assert terms["total"] == sum(v for k, v in terms.items() if k != "total")
        assert all(v >= 0 for v in terms.values()) and s["fits"] is False
        assert s["mib"]["total"] == round(terms["total"] / 2**20, 1)
        assert {"model", "weights", "trainable", "optimizer", "activations", "overhead",
                "settings"} <= set(s["sources"])
    assert pre["params"]["trainable"] == pre["params"]["total"]  # full fine-tuning
    assert 0 < tune["params"]["trainable"] < tune["params"]["total"] // 10  # LoRA r=4
    assert tune["bytes"]["gradients"] < pre["bytes"]["gradients"]
    assert out["peak_bytes"] == max(s["bytes"]["total"] for s in out["stages"])


# -- components that answer nothing get the fallbacks ----------------------------------------------
def _third_party_plugin():
    """A loader, quantizer, adapter and trainer with none of the estimate's optional methods."""
    import ftcore
    from ftcore.component import Component, Options

    class PathOptions(Options):
        path: str

    class Loader(Component):
        name = "bare-loader"
        Options = PathOptions

        def load(self, ctx):  # pragma: no cover - never called by the estimate
            raise AssertionError("the estimate must not load the model")

    class Quantizer(Component):
        name = "bare-quantizer"

        def load_kwargs(self):
            return {}

        def prepare(self, model):  # pragma: no cover
            return model

    class Adapter(Component):
        name = "bare-adapter"

        def apply(self, model, ctx):  # trains only the output head
            for name, p in model.named_parameters():
                p.requires_grad_(name.startswith("lm_head"))
            return model

        def save(self, model, path):  # pragma: no cover
            pass

        def restore(self, base, path, ctx):  # pragma: no cover
            return base

        def merge(self, model):  # pragma: no cover
            return model

    class TrainerOptions(Options):
        batch_size: int = 3
        max_length: int = 40

    class Trainer(Component):
        name = "bare-trainer"
        Options = TrainerOptions

        def train(self, ctx):  # pragma: no cover
            return {}

    class Plugin:
        @ftcore.hookimpl
        def register_model_loaders(self, register):
            register(Loader)

        @ftcore.hookimpl
        def register_quantizers(self, register):
            register(Quantizer)

        @ftcore.hookimpl
        def register_adapters(self, register):
            register(Adapter)

        @ftcore.hookimpl
        def register_trainers(self, register):
            register(Trainer)

    return Plugin()


def test_components_without_the_optional_methods_get_stated_fallbacks(tmp_path):
    from ftcore_plugins.commands.estimate import estimate_plan
    from ftcore.plan import load_plan
    from ftcore.plugins import PluginInfo, get_plugin_manager

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(
        {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_hidden_layers": 2, "vocab_size": 1000, "tie_word_embeddings": False}))
    (tmp_path / "rows.jsonl").write_text("")
    plan_path = tmp_path / "plan.toml"
    plan_path.write_text('[model]\nuse = "bare-loader"\npath = "MODEL"\n\n[quantizer]\nuse = "bare-quantizer"\n\n'
                         '[data.rows]\nuse = "jsonl"\npath = "rows.jsonl"\n\n[[stage]]\ntrainer = "bare-trainer"\n'
                         'data = "rows"\nadapter = "bare-adapter"\n'.replace("MODEL", str(tmp_path / "model")))
    pm = get_plugin_manager(entry_points=False)
    pm.add_plugin(_third_party_plugin(), PluginInfo("bare", "ftcore-tests", "0", "entry point"))
    result = estimate_plan(load_plan(plan_path, pm.registry()), device="cpu")
    (s,) = result.stages
    params = 1000 * 64 * 2 + 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64
    assert (s.total_params, s.trainable_params) == (params, 1000 * 64)
    assert s.sources["model"] == "fallback: config.json at the loader's path"
    assert s.sources["weights"] == "parameters x their dtype size" and s.weights >= 4 * params
    assert s.sources["settings"] == "fallback: the trainer's options"
    assert (s.settings.batch_size, s.settings.seq_len, s.settings.optimizer, s.settings.precision) == (
        3, 40, "adamw_torch", "fp32")
    assert s.gradients == 4 * 1000 * 64 and s.optimizer == 8 * 1000 * 64
    assert s.sources["activations"] == "fallback: generic decoder formula" and s.activations > 0
    assert s.sources["optimizer"].startswith("fallback") and s.overhead > 0
    assert any("no memory_settings()" in n for n in s.notes)
    assert any("no runtime_bytes()" in n for n in s.notes)


# -- the seed design's 7B figures ---------------------------------------------------------------
LLAMA_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 11008, "num_attention_heads": 32, "num_hidden_layers": 32,
            "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "float16",
            "bos_token_id": 1, "eos_token_id": 2}

# batch 1 x 512 tokens; fp32 weights and training for the full fine-tune, a bf16 base for LoRA,
# nf4 with double quantization and checkpointing (the quantizer's default) for QLoRA; r = 8 on
# every linear layer. On a GPU (bf16 autocast where the trainer's precision is "auto").
SEVEN_B = {
    "full": ('dtype = "float32"', "", '"full"', 'precision = "fp32"'),
    "lora": ('dtype = "bfloat16"', "", '{ use = "lora", r = 8 }', ""),
    "qlora": ("", '[quantizer]\nuse = "bnb-nf4"', '{ use = "lora", r = 8 }', ""),
}


@pytest.fixture(scope="module")
def seven_b(tmp_path_factory):
    """The three 7B plans, estimated for CUDA with --budget 16GB: {name: (exit code, json)}.
    The model folder holds only config.json: no weights, no tokenizer."""
    folder = tmp_path_factory.mktemp("llama-7b")
    (folder / "llama-7b").mkdir()
    (folder / "llama-7b" / "config.json").write_text(json.dumps(LLAMA_7B))
    (folder / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                                {"role": "assistant", "content": "hello"}]}) + "\n")
    plans = {}
    for name, (dtype, quantizer, adapter, precision) in SEVEN_B.items():
        plans[name] = folder / f"{name}.toml"
        plans[name].write_text(f"""
[model]
use = "hf"
path = "llama-7b"
{dtype}

{quantizer}

[template]
use = "chatml"

[data.chat]
use = "jsonl"
path = "chat.jsonl"

[[stage]]
name = "{name}"
trainer = "sft"
data = "chat"
adapter = {adapter}
batch_size = 1
max_length = 512
{precision}
""")

    def estimate(name):
        result = run_cli("estimate", str(plans[name]), "--json", "--device", "cuda", "--budget", "16GB")
        assert result.returncode in (0, 1), result.stderr
        return name, (result.returncode, json.loads(result.stdout))

    def compute() -> dict:
        with ThreadPoolExecutor(max_workers=3) as pool:
            return dict(pool.map(estimate, SEVEN_B))

    return computed_once(tmp_path_factory, "seven-b-estimates", compute)  # one set for the xdist workers


def test_7b_full_fine_tune_fp32_adam_is_about_112_gb(seven_b):
    code, out = seven_b["full"]
    s = out["stages"][0]
    assert s["params"] == {"total": 6_738_415_616, "trainable": 6_738_415_616}
    b = s["bytes"]
    # The seed design's 16 bytes per parameter: fp32 weights, gradients and Adam's two moments.
    assert b["gradients"] == 4 * 6_738_415_616
    assert b["weights"] == pytest.approx(4 * 6_738_415_616, rel=1e-6)  # and the rotary buffer
    state = 8 * 6_738_415_616
    assert b["optimizer"] >= state
    assert (b["weights"] + b["gradients"] + state) / GB == pytest.approx(112, rel=0.05)  # 107.8 GB
    # The whole step also holds activations and, on CUDA, foreach Adam's temporaries.
    assert 112 <= b["total"] / GB <= 1.3 * 112
    assert code == 1 and s["fits"] is False


def test_7b_lora_is_about_16_gb(seven_b):
    code, out = seven_b["lora"]
    s = out["stages"][0]
    assert s["params"]["trainable"] == 19_988_480  # r=8 on q, k, v, o, gate, up, down of 32 layers
    assert s["bytes"]["weights"] == pytest.approx(2 * 6_738_415_616 + 4 * 19_988_480, rel=1e-6)  # bf16 + fp32 LoRA
    assert s["precision"] == "bf16" and not s["gradient_checkpointing"]
    assert 0.8 * 16 <= s["bytes"]["total"] / GB <= 1.25 * 16
    assert code == 1 and s["fits"] is False  # just over 16 GiB without checkpointing


def test_7b_qlora_is_about_6_to_8_gb(seven_b):
    code, out = seven_b["qlora"]
    s = out["stages"][0]
    assert s["gradient_checkpointing"] is True  # the bnb quantizers turn it on
    assert "weight_bytes" in s["sources"]["weights"]
    # 4-bit linear layers with double-quantized constants, fp16 embeddings and head (on CUDA prepare
    # leaves them in the model's dtype: fp32_non_quantized's default there), fp32 LoRA
    assert 3.5 <= s["bytes"]["weights"] / GiB <= 3.8
    assert 0.85 * 6 <= s["bytes"]["total"] / GB <= 8
    assert code == 0 and s["fits"] is True and out["fits"] is True


# -- QLoRA: what stays in fp32, per device ---------------------------------------------------------
# Llama-3-8B's shapes with 2 of its 32 layers (fast on the meta device)
LLAMA3_8B_2L = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
                "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 2,
                "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
                "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
                "torch_dtype": "bfloat16"}


def test_qlora_weights_count_the_fp32_copies_the_device_keeps(tmp_path):
    """CPU keeps norms, embeddings and head in fp32 (peft's upcast), CUDA in the model's bf16, unless the
    plan says: the weights differ by exactly those weights' two extra bytes each, whatever the machine."""
    from ftcore.plan import load_plan
    from ftcore.plugins import get_plugin_manager
    from ftcore_plugins.commands.estimate import estimate_plan

    (tmp_path / "llama3-8b").mkdir()
    (tmp_path / "llama3-8b" / "config.json").write_text(json.dumps(LLAMA3_8B_2L))
    (tmp_path / "rows.jsonl").write_text("")
    registry = get_plugin_manager(entry_points=False).registry()

    def weights(device, option=""):
        path = tmp_path / "plan.toml"
        path.write_text(f'[model]\nuse = "hf"\npath = "llama3-8b"\n\n[quantizer]\nuse = "bnb-nf4"\n{option}\n\n'
                        '[adapter]\nuse = "lora"\nr = 16\n\n[data.rows]\nuse = "jsonl"\npath = "rows.jsonl"\n\n'
                        '[[stage]]\ntrainer = "sft"\ndata = "rows"\nbatch_size = 1\nmax_length = 2048\n')
        return estimate_plan(load_plan(path, registry), device=device).stages[0].weights

    h, vocab, layers = (LLAMA3_8B_2L[k] for k in ("hidden_size", "vocab_size", "num_hidden_layers"))
    non_quantized = 2 * vocab * h + (2 * layers + 1) * h  # embeddings, untied head, two norms a layer and the last
    cpu, cuda = weights("cpu"), weights("cuda")
    assert cpu - cuda == non_quantized * (4 - 2)
    assert weights("cuda", "fp32_non_quantized = true") == cpu
    assert weights("cpu", "fp32_non_quantized = false") == cuda


@pytest.fixture(scope="module")
def small_bf16_llama(tmp_path_factory):
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=8,
                                  num_key_value_heads=2, intermediate_size=896, tie_word_embeddings=False)
    folder = tmp_path_factory.mktemp("bf16-llama")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    return folder, config


@pytest.mark.parametrize("fp32, precision, device", [
    (False, "bf16", "cuda"),  # the CUDA default: bf16 norms, embeddings and head
    (True, "bf16", "cuda"),  # fp32_non_quantized = true on CUDA: an fp32 residual stream
    (False, "fp32", "cpu"),  # a bf16 base on CPU without the upcast
    (False, "bf16", "cpu"),
    (True, "fp32", "cpu"),  # the CPU default (the formula of the other bases)
])
def test_a_4bit_layer_saves_what_the_estimate_counts(small_bf16_llama, fp32, precision, device):
    """Bytes one decoder layer of a 4-bit Llama with LoRA on every linear layer keeps for backward per
    token, counted with saved-tensor hooks (unique storages), against the estimate's count. CUDA's path
    runs on the CPU with CPU autocast and peft's test of CUDA's autocast answered yes."""
    pytest.importorskip("bitsandbytes")
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from ftcore_plugins.common.estimate import bnb_prepare_meta, layer_activation_bytes, meta_model_from_config
    from ftcore_plugins.quantizers.bnb_nf4 import NF4Quantizer

    folder, config = small_bf16_llama

    def lora(model):
        return get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=16, lora_alpha=32, target_modules="all-linear"))

    q = NF4Quantizer(NF4Quantizer.Options(fp32_non_quantized=fp32, gradient_checkpointing=False,
                                          bnb_4bit_compute_dtype="bfloat16"))
    model = lora(q.prepare(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, **q.load_kwargs())))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    decoder = model.get_base_model().model

    def saved(tokens):
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        x = torch.randn(1, tokens, config.hidden_size, dtype=decoder.embed_tokens.weight.dtype, requires_grad=True)
        positions = torch.arange(tokens)[None]
        rotary = decoder.rotary_emb(x, positions)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            decoder.layers[0](x, position_embeddings=rotary, position_ids=positions)
        return sum(storages.values()) - sum(t.untyped_storage().nbytes() for t in rotary)  # shared by the layers

    autocast_enabled = torch.is_autocast_enabled
    if device == "cuda":  # peft's bnb layers ask torch.is_autocast_enabled(), which is CUDA's
        torch.is_autocast_enabled = lambda *a: True if not a else autocast_enabled(*a)
    try:
        measured = (saved(256) - saved(128)) / 128
    finally:
        torch.is_autocast_enabled = autocast_enabled

    meta = lora(bnb_prepare_meta(NF4Quantizer(NF4Quantizer.Options(fp32_non_quantized=fp32)),
                                 meta_model_from_config(config, torch.bfloat16), device=device))
    counted = layer_activation_bytes(config, meta, device=device, precision=precision)
    assert counted == pytest.approx(measured, rel=0.01), (counted, measured)


def test_the_chunked_loss_is_counted_at_the_devices_chunk():
    from ftcore_plugins.common.device_defaults import defaults
    from ftcore_plugins.common.estimate import _loss_kernel, loss_chunk_elements
    from ftcore_plugins.trainers.sft import SFT

    sft = SFT()
    for device in ("cpu", "cuda"):
        assert loss_chunk_elements(sft, device) == defaults(device).loss_chunk_elements
    assert loss_chunk_elements(type("Own", (SFT,), {"loss_chunk_elements": 1 << 20})(), "cuda") == 1 << 20
    assert defaults("cuda").loss_chunk_elements != defaults("cpu").loss_chunk_elements
    assert _loss_kernel(sft, "cpu") == "chunked"


def test_activation_offloading_takes_the_layers_inputs_off_the_gpu():
    """With offloading (CUDA only: transformers' save_on_cpu needs pinned memory), the checkpointed
    layers' inputs wait in host memory: the estimate keeps one of them on the GPU instead of all."""
    from transformers import AutoConfig

    from ftcore_plugins.common.estimate import trainer_activation_bytes, trainer_memory_settings
    from ftcore_plugins.trainers.sft import SFT

    config = AutoConfig.for_model(**{k: v for k, v in LLAMA3_8B_2L.items() if k != "architectures"})
    plain, offloaded = SFT(), SFT(SFT.Options(activation_offloading=True))
    tokens, layers, width = 2 * 2048, config.num_hidden_layers, config.hidden_size
    for device in ("cpu", "cuda"):
        before, after = (trainer_activation_bytes(t, config, 2, 2048, True, device=device, precision="bf16")
                         for t in (plain, offloaded))
        # all layers' inputs but one, of the residual stream's 2 or 4 bytes (without a model the estimate
        # assumes fp32); a CPU has no GPU memory to free, so nothing changes there
        freed, one = before - after, (layers - 1) * tokens * width
        assert (freed in (2 * one, 4 * one)) if device == "cuda" else freed == 0
    # Offloading turns checkpointing on, as the Trainer does, and says where the inputs went.
    settings = trainer_memory_settings(offloaded, device="cuda")
    assert settings["gradient_checkpointing"] is True and any("offloading" in n for n in settings["notes"])
    assert trainer_memory_settings(offloaded, device="cpu")["gradient_checkpointing"] is False


def test_activation_offloading_asks_the_trainer_for_offloaded_checkpointing_on_a_gpu(monkeypatch):
    """The Trainer's own offload (activation_checkpointing_kwargs offload) on a GPU; nothing on a CPU. The
    GPU half stands in torch.cuda.is_available: this machine has none."""
    import torch

    from ftcore_plugins.trainers._training import TrainOptions, checkpointing_arguments

    o = TrainOptions(activation_offloading=True)
    assert checkpointing_arguments(o) == {"activation_checkpointing": False}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert checkpointing_arguments(o) == {"activation_checkpointing": True, "activation_checkpointing_kwargs":
                                          {"use_reentrant": False, "offload": True}}
    assert checkpointing_arguments(TrainOptions(gradient_checkpointing=True)) == {"activation_checkpointing": True}


def test_dequantized_copies_count_most_once_the_activations_outgrow_them():
    """Qwen2.5-0.5B's linear layers (widest output 4,864, largest copy 4,864 x 896): at 2 x 256 tokens the
    activations are smaller than the largest fp32 copy and reuse most of the copies' space; at 2 x 512 they
    are larger and 0.85 of one copy of each quantized weight stays (RESULTS.md's quantizer memory tables)."""
    torch = pytest.importorskip("torch")
    from transformers import Qwen2Config

    from ftcore_plugins.common.estimate import DEQUANT_RESIDUE, DEQUANT_RESIDUE_REUSED as REUSED, \
        dequantized_step_bytes, meta_model_from_config

    config = Qwen2Config(hidden_size=896, num_hidden_layers=2, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True)
    model = meta_model_from_config(config, torch.float32)
    attention, mlp = 896 * 896 * 2 + 896 * 128 * 2, 3 * 896 * 4864  # q, o; k, v / gate, up, down: weights a layer
    assert dequantized_step_bytes(model, [], tokens=2 * 256) == int(REUSED * 2 * 4 * (attention + mlp))
    assert dequantized_step_bytes(model, [], tokens=2 * 512) == int(DEQUANT_RESIDUE * 2 * 4 * (attention + mlp))
    assert dequantized_step_bytes(model, [], tokens=2 * 512, size=2) == int(DEQUANT_RESIDUE * 2 * 2 * (attention + mlp))
    assert dequantized_step_bytes(model, [], device="cuda", tokens=2 * 512) == 0
    # Without the MLPs the widest output is 896, the largest copy 896 x 896: 512 tokens fit in it, 1,024 do not.
    assert dequantized_step_bytes(model, ["mlp"], tokens=512) == int(REUSED * 2 * 4 * attention)
    assert dequantized_step_bytes(model, ["mlp"], tokens=1024) == int(DEQUANT_RESIDUE * 2 * 4 * attention)


# -- estimate vs measured -------------------------------------------------------------------------
def measured(tmp_path_factory, name: str) -> bench.Result:
    """Configuration ``name`` estimated and measured once per session (``computed_once``): each xdist worker
    measures the configurations its tests ask for, side by side with the other's (a run measures its own
    process's memory), in one project the workers share."""
    folder = Path(computed_once(tmp_path_factory, "memory-estimate-project",
                                lambda: str(bench.write_project(tmp_path_factory.mktemp("memory-estimate")))))
    config = next(c for c in bench.CONFIGS if c.name == name)

    def compute() -> dict:
        (r,) = bench.run_all([config], folder, jobs=1)
        return {"estimate": r.estimate, "measured_mib": r.measured_mib, "seconds": r.seconds}

    r = computed_once(tmp_path_factory, f"memory-estimate-{name}", compute)
    return bench.Result(config, r["estimate"], r["measured_mib"], r["seconds"])


@pytest.mark.slow
@pytest.mark.parametrize("name", [c.name for c in bench.CONFIGS])
def test_estimate_is_within_25_percent_of_the_measured_peak(tmp_path_factory, name):
    r = measured(tmp_path_factory, name)
    assert abs(r.error) <= bench.TOLERANCE, (
        f"{name}: estimate {r.estimate_mib:.0f} MiB, measured {r.measured_mib:.0f} MiB ({100 * r.error:+.1f}%); "
        f"notes: {r.stage['notes']}\n{bench.table([r])}")
