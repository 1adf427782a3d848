"""The bitsandbytes quantizers on CPU: QLoRA on a tiny local Llama (4-bit NF4 base, fp32
LoRA, a few SFT steps), FP4 and int8 loading and training, the saved adapter on a freshly
quantized base, and the plan checks that refuse what cannot work.

Everything here runs for real on the CPU (bitsandbytes >= 0.48 has CPU kernels); only the
multi-GPU ``device_map`` is checked with CUDA mocked, since it is a CUDA-only path.
"""

from __future__ import annotations

import json

import pytest

import ftcore
from ftcore.component import Component
from ftcore.errors import FtcoreError, PlanError

from conftest import chat_rows, text_rows, write_jsonl

bnb = pytest.importorskip("bitsandbytes")
torch = pytest.importorskip("torch")

SPECIALS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]


# -- a tiny pretrained-looking Llama in a local folder -----------------------------------------
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A random-init Llama saved with a BPE tokenizer trained here, on the test's own rows
    (no download): what ``[model] use = "hf"`` loads from a local folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    texts = [m["content"] for row in chat_rows(200) for m in row["messages"]]
    texts += [row["text"] for row in text_rows(50)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>",
                                        additional_special_tokens=SPECIALS[2:])
    config = AutoConfig.for_model("llama", vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                                  max_position_embeddings=128, tie_word_embeddings=False,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out = tmp_path_factory.mktemp("tiny-llama") / "base"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# -- a test plugin that looks at the trained model from inside a real run -----------------------
SEEN: dict = {}
PROBE = [[5, 17, 42, 99, 7, 3, 150, 60]]


class InspectExporter(Component):
    """Records what the trained model is made of, and its logits on a fixed input."""

    name = "inspect"

    def export(self, ctx):
        model = ctx.model
        base = model.get_base_model()
        linears = {n: m for n, m in base.named_modules()
                   if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))}
        SEEN.clear()
        SEEN["linear_types"] = {type(m).__name__ for m in linears.values()}
        SEEN["linear_names"] = sorted(linears)
        SEEN["weights"] = {n: m.weight for n, m in linears.items()}
        SEEN["trainable"] = {n: (p.dtype, p.requires_grad) for n, p in model.named_parameters() if p.requires_grad}
        SEEN["lora_params"] = {n: (p.dtype, p.requires_grad) for n, p in model.named_parameters() if "lora_" in n}
        SEEN["use_cache"] = base.config.use_cache
        SEEN["checkpointing"] = base.is_gradient_checkpointing
        layer = base.model.layers[0]
        SEEN["checkpoint_kwargs"] = getattr(getattr(layer, "_gradient_checkpointing_func", None), "keywords", None)
        SEEN["lm_head"] = type(base.lm_head).__name__
        was_training = model.training
        model.eval()
        with torch.no_grad():
            SEEN["logits"] = model(input_ids=torch.tensor(PROBE)).logits.float().clone()
        model.train(was_training)
        ctx.path.mkdir(parents=True)
        return ctx.path


class InspectPlugin:
    @ftcore.hookimpl
    def register_exporters(self, register):
        register(InspectExporter)


def plan_text(quantizer: str, steps: int, extra_export: str = "") -> str:
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
{extra_export}
"""


def registry_with_inspector():
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
    pm = registry_with_inspector()
    plan = load_plan(path, pm.registry())
    with open(folder / "console.txt", "w") as out:
        Runner(plan, pm, Console(file=out, width=200)).run()
    return folder / "runs" / "q"


def losses(run_dir) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r.get("stage") == "sft" and "loss" in r]


@pytest.fixture
def project(tmp_path, tiny_llama):
    import shutil

    shutil.copytree(tiny_llama, tmp_path / "base")
    write_jsonl(tmp_path / "chat.jsonl", chat_rows(64))
    return tmp_path


def test_explore(project):
    import time
    t = time.time()
    run = run_plan(project, plan_text('use = "bnb-nf4"\nbnb_4bit_use_double_quant = true', 8))
    print("time", time.time() - t)
    print(losses(run))
    for k, v in SEEN.items():
        if k not in ("weights", "logits"):
            print(k, v)
    w = next(iter(SEEN["weights"].values()))
    print(type(w), w.dtype, w.quant_state, w.quant_state.nested, w.quant_state.quant_type)
