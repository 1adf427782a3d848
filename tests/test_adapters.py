"""Adapters: target-module detection on tiny models of nine architectures; every adapter trains
through a plan (loss falls, the trainable share is reported and recorded); save -> restore gives
identical outputs; LoRA+ really trains with its optimizer; prompt learning and LoftQ are refused
where they cannot work; freeze trains what it says; a crash between stages resumes exactly."""

from __future__ import annotations

import json
import shutil

import pytest

from ftcore.errors import FtcoreError, PlanError
from ftcore.plan import load_plan
from ftcore.plugins import get_plugin_manager

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

PM = get_plugin_manager(entry_points=False)
REGISTRY = PM.registry()


def adapter(name: str, **options):
    reg = REGISTRY.resolve("adapter", name)
    return reg.cls(reg.cls.Options(**options))


class Quiet:
    """A reporter that keeps its messages (AdapterContext.reporter)."""

    def __init__(self):
        self.messages: list[str] = []

    def info(self, message):
        self.messages.append(message)

    def log(self, *args, **kwargs):
        pass


def adapter_ctx():
    from ftcore.context import AdapterContext

    return AdapterContext(None, Quiet(), None)


# -- tiny models of each architecture -------------------------------------------------------------

SIZES = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, vocab_size=64,
             max_position_embeddings=64)
GPT_SIZES = dict(n_embd=16, n_layer=2, n_head=2, vocab_size=64, n_positions=64)
ARCHITECTURES = {
    # model_type: (config fields, attention layers, MLP layers, IA3 feedforward layers)
    "llama": (dict(SIZES, num_key_value_heads=1), ["q_proj", "k_proj", "v_proj", "o_proj"],
              ["gate_proj", "up_proj", "down_proj"], ["down_proj"]),
    "qwen2": (dict(SIZES, num_key_value_heads=1), ["q_proj", "k_proj", "v_proj", "o_proj"],
              ["gate_proj", "up_proj", "down_proj"], ["down_proj"]),
    "qwen3": (dict(SIZES, num_key_value_heads=1, head_dim=8), ["q_proj", "k_proj", "v_proj", "o_proj"],
              ["gate_proj", "up_proj", "down_proj"], ["down_proj"]),
    "mistral": (dict(SIZES, num_key_value_heads=1), ["q_proj", "k_proj", "v_proj", "o_proj"],
                ["gate_proj", "up_proj", "down_proj"], ["down_proj"]),
    "gemma": (dict(SIZES, num_key_value_heads=1, head_dim=8), ["q_proj", "k_proj", "v_proj", "o_proj"],
              ["gate_proj", "up_proj", "down_proj"], ["down_proj"]),
    "phi3": (dict(SIZES, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2),
             ["qkv_proj", "o_proj"], ["gate_up_proj", "down_proj"], ["down_proj"]),
    # GPT-2: Conv1D layers, and attention and MLP output layers both named c_proj.
    "gpt2": (dict(GPT_SIZES, bos_token_id=1, eos_token_id=2), ["c_attn", "attn.c_proj"], ["c_fc", "mlp.c_proj"],
             ["mlp.c_proj"]),
    "gpt_neox": (dict(SIZES, bos_token_id=1, eos_token_id=2), ["query_key_value", "dense"],
                 ["dense_h_to_4h", "dense_4h_to_h"], ["dense_4h_to_h"]),
    "gptj": (dict(GPT_SIZES, rotary_dim=4, bos_token_id=1, eos_token_id=2), ["q_proj", "k_proj", "v_proj", "out_proj"],
             ["fc_in", "fc_out"], ["fc_out"]),
}


def tiny_model(model_type: str = "llama", seed: int = 0, **fields):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**ARCHITECTURES[model_type][0], **fields})
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def adapted(model) -> list[str]:
    """Paths of the layers peft wrapped (LoRA or IA3), as in the base model."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return sorted(p.split("base_model.model.", 1)[1] for p, m in model.named_modules() if isinstance(m, BaseTunerLayer))


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_target_presets_per_architecture(model_type):
    from ftcore_plugins.adapters._targets import resolve

    _, attention, mlp, feedforward = ARCHITECTURES[model_type]
    model = tiny_model(model_type)
    layers = model.config.num_hidden_layers
    found = {preset: resolve(model, preset) for preset in ("attention", "mlp", "all-linear")}
    assert sorted(found["attention"].names) == sorted(attention)
    assert sorted(found["mlp"].names) == sorted(mlp)
    assert len(found["attention"].modules) == layers * len(attention)
    assert len(found["mlp"].modules) == layers * len(mlp)
    assert sorted(found["all-linear"].modules) == sorted(found["attention"].modules + found["mlp"].modules)
    heads = {p for p, m in model.named_modules() if m is model.get_output_embeddings()}
    embeddings = {p for p, m in model.named_modules() if isinstance(m, torch.nn.Embedding)}
    assert heads and embeddings
    assert not (set(found["all-linear"].modules) & (heads | embeddings))  # never by default
    assert found["all-linear"].conv1d == (model_type == "gpt2")

    # peft adapts exactly those layers (fan_in_fan_out set for GPT-2's Conv1D), and the adapter merges
    # into the same function it computes.
    ids = torch.randint(3, 64, (2, 10))
    lora = adapter("lora", r=4, target_modules="attention").apply(tiny_model(model_type), adapter_ctx())
    assert adapted(lora) == sorted(found["attention"].modules)
    assert lora.peft_config["default"].fan_in_fan_out == (model_type == "gpt2")
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
        before = lora(input_ids=ids).logits
        merged = lora.merge_and_unload()(input_ids=ids).logits
    assert torch.allclose(before, merged, atol=1e-5)

    # IA3 scales the input of the MLP's output projection, the output of every other targeted layer.
    ia3 = adapter("ia3").apply(tiny_model(model_type), adapter_ctx())
    assert adapted(ia3) == sorted(found["all-linear"].modules)
    assert sorted(ia3.peft_config["default"].feedforward_modules) == sorted(feedforward)
    flagged = sorted(p.split("base_model.model.", 1)[1] for p, m in ia3.named_modules()
                     if getattr(m, "is_feedforward", False))
    assert len(flagged) == layers and all(any(p.endswith("." + f) for f in feedforward) for p in flagged)


def test_an_unknown_target_is_one_line_listing_the_linear_layers():
    from ftcore_plugins.adapters._targets import resolve

    model = tiny_model("llama")
    with pytest.raises(FtcoreError) as err:
        resolve(model, ["q_proj", "qproj"])
    message = str(err.value)
    assert "\n" not in message and "'qproj' matches no module" in message
    assert "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head" in message
    with pytest.raises(FtcoreError, match="'self_attn' names LlamaAttention modules, not linear"):
        resolve(model, ["self_attn"])
    # Through the adapter, as a run meets it: before peft touches the model.
    with pytest.raises(FtcoreError, match="'wq' matches no module in this gpt2 model; its linear layers are: "
                                          "c_attn, c_proj, c_fc, lm_head$"):
        adapter("dora", target_modules=["wq"]).apply(tiny_model("gpt2"), adapter_ctx())
    # Named explicitly, the head and the embeddings can be adapted.
    explicit = resolve(model, ["lm_head", "embed_tokens", "self_attn.q_proj"])
    assert sorted(explicit.modules) == ["lm_head", "model.embed_tokens", "model.layers.0.self_attn.q_proj",
                                        "model.layers.1.self_attn.q_proj"]
    assert sorted(explicit.names) == ["embed_tokens", "lm_head", "q_proj"]


# -- every adapter: save -> restore -> the same outputs ---------------------------------------------

ALL = ["lora", "dora", "rslora", "pissa", "olora", "loraplus", "ia3", "prompt_tuning", "prefix_tuning", "full",
       "freeze"]
OPTIONS = {"prefix_tuning": {"prefix_projection": True}, "prompt_tuning": {"num_virtual_tokens": 4}}


@pytest.mark.parametrize("name", ALL)
def test_save_then_restore_gives_identical_outputs(name, tmp_path):
    component = adapter(name, **OPTIONS.get(name, {}))
    ids = torch.randint(0, 64, (2, 12))
    base = tiny_model()
    with torch.no_grad():
        plain = base(input_ids=ids).logits
    model = component.apply(base, adapter_ctx())
    trainable = [p for p in model.parameters() if p.requires_grad]
    share = sum(p.numel() for p in trainable)
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    model.train()
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        trained = model(input_ids=ids).logits
    # The adapter does something, so restoring it means something (prompt tuning's logits also
    # cover its virtual tokens).
    assert not torch.allclose(trained[:, -ids.shape[1]:], plain)

    component.save(model, tmp_path / "out")
    torch.manual_seed(1234)  # any random init during restore differs from the one during apply
    restored = adapter(name, **OPTIONS.get(name, {})).restore(tiny_model(), tmp_path / "out", adapter_ctx()).eval()
    with torch.no_grad():
        again = restored(input_ids=ids).logits
    assert torch.equal(trained, again)
    # Restored trainable, as a later stage with the same adapter continues training it. (peft saves
    # a projected prefix without its MLP: the restored one trains the prefixes themselves.)
    if name == "prefix_tuning":
        share = restored.prompt_encoder["default"].embedding.weight.numel()
    assert sum(p.numel() for p in restored.parameters() if p.requires_grad) == share

    if getattr(component, "mergeable", True):
        with torch.no_grad():
            merged = component.merge(restored)(input_ids=ids).logits
        assert torch.allclose(merged, trained, atol=1e-5)
    else:
        with pytest.raises(FtcoreError, match="cannot be merged"):
            component.merge(restored)


# -- every adapter trains through a plan -----------------------------------------------------------

# (adapter as the plan writes it, learning rate, what the exported adapter_config.json must say)
TRAINED = {
    "lora": ('"lora"', 3e-3, {"peft_type": "LORA", "use_dora": False, "use_rslora": False,
                              "init_lora_weights": True}),
    "dora": ('{ use = "dora", r = 4 }', 3e-3, {"peft_type": "LORA", "use_dora": True, "r": 4}),
    "rslora": ('"rslora"', 3e-3, {"peft_type": "LORA", "use_rslora": True}),
    "pissa": ('"pissa"', 3e-3, {"peft_type": "LORA", "init_lora_weights": "pissa"}),
    "olora": ('{ use = "olora", target_modules = "mlp" }', 3e-3,
              {"peft_type": "LORA", "init_lora_weights": "olora",
               "target_modules": ["down_proj", "gate_proj", "up_proj"]}),
    "loraplus": ('{ use = "loraplus", loraplus_lr_ratio = 8.0 }', 1e-3, {"peft_type": "LORA"}),
    "ia3": ('"ia3"', 0.3, {"peft_type": "IA3", "feedforward_modules": ["down_proj"]}),
    "prompt_tuning": ('"prompt_tuning"', 0.3, {"peft_type": "PROMPT_TUNING", "num_virtual_tokens": 20}),
    "prefix_tuning": ('"prefix_tuning"', 0.1, {"peft_type": "PREFIX_TUNING"}),
    "full": ('"full"', 3e-3, None),
    "freeze": ('{ use = "freeze", trainable_layers = 1 }', 3e-3, None),
}

STAGE = """
[[stage]]
name = "sft"
trainer = "sft"
data = "chat"
adapter = {adapter}
max_steps = {steps}
batch_size = 8
max_length = 64
learning_rate = {lr}
logging_steps = 1
save_steps = 1000
"""


def run_plan(path, resume: bool = False) -> dict:
    """Run a plan in this process, through the same Runner the CLI uses."""
    from ftcore.runner import Runner

    return Runner(load_plan(path, REGISTRY), PM, None, resume=resume).run()


def records(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TRAINED))
def test_adapter_trains_through_a_plan(name, tiny_project):
    written, lr, expected = TRAINED[name]
    export = '\n[[export]]\nuse = "adapter"\n' if expected else '\n[[export]]\nuse = "merged"\n'
    run_plan(tiny_project(STAGE.format(adapter=written, steps=12, lr=lr) + export))
    run = tiny_project.dir / "runs" / "tiny"

    losses = [r["loss"] for r in records(run) if r["stage"] == "sft" and "loss" in r]
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.03, losses

    # The trainable share: reported when the adapter is applied, recorded in metrics.jsonl and the stage's metrics.
    metrics = json.loads((run / "stages" / "sft" / "COMPLETE.json").read_text())["metrics"]
    share = metrics["trainable_percent"]
    assert metrics["trainable_params"] == round(metrics["total_params"] * share / 100)
    assert share == 100.0 if name == "full" else 0 < share < 60
    log = (run / "run.log").read_text()
    assert f"trainable parameters of {metrics['total_params']:,} ({share:.2f}%)" in log
    assert any(r.get("trainable_percent") == share for r in records(run) if r["stage"] == "sft")

    if expected:  # the adapter really is the method it is named after
        config = json.loads((run / "exports" / "adapter" / "adapter_config.json").read_text())
        for key, value in expected.items():
            assert (sorted(config[key]) if isinstance(value, list) else config[key]) == value, key
    else:
        assert (run / "exports" / "merged" / "model.safetensors").exists()


@pytest.mark.slow
def test_loraplus_trains_with_its_optimizer(tiny_project):
    """One Adam step moves each weight by about the learning rate. LoRA's B starts at zero, so after
    one step max|B| is about the learning rate for LoRA, and ratio times that for LoRA+."""
    from safetensors.torch import load_file

    biggest = {}
    for name, written in (("lora", '"lora"'), ("loraplus", '{ use = "loraplus", loraplus_lr_ratio = 16.0 }')):
        plan = tiny_project(STAGE.format(adapter=written, steps=1, lr=1e-3), name=f"{name}.toml")
        text = plan.read_text().replace('name = "tiny"', f'name = "{name}"')
        plan.write_text(text)
        run_plan(plan)
        weights = load_file(tiny_project.dir / "runs" / name / "stages" / "sft" / "output" / "adapter_model.safetensors")
        biggest[name] = max(w.abs().max().item() for k, w in weights.items() if "lora_B" in k)
    assert biggest["lora"] == pytest.approx(1e-3, rel=0.02)
    assert biggest["loraplus"] == pytest.approx(16e-3, rel=0.02)


# -- plan checks -------------------------------------------------------------------------------------

def problems(tiny_project, body: str) -> str:
    with pytest.raises(PlanError) as err:
        load_plan(tiny_project(body), REGISTRY)
    return str(err.value)


def test_prompt_learning_cannot_be_merged_and_validation_says_so(tiny_project):
    two = STAGE.format(adapter='"prompt_tuning"', steps=2, lr=0.1) + \
        STAGE.format(adapter='"lora"', steps=2, lr=0.1).replace('name = "sft"', 'name = "more"')
    message = problems(tiny_project, two)
    assert "stage[0].adapter: stage 'more' uses adapter 'lora' after this stage" in message
    assert "prompt_tuning trains virtual tokens, not weights, so it cannot be merged" in message

    merged = STAGE.format(adapter='"prefix_tuning"', steps=2, lr=0.1) + '\n[[export]]\nuse = "merged"\n'
    message = problems(tiny_project, merged)
    assert "stage[0].adapter: [[export]] 'merged'" in message and 'use = "adapter" instead' in message

    packed = STAGE.format(adapter='"prompt_tuning"', steps=2, lr=0.1) + "packing = true\n"
    assert "set packing = false" in problems(tiny_project, packed)

    text = STAGE.format(adapter='{ use = "prompt_tuning", prompt_tuning_init = "TEXT" }', steps=2, lr=0.1)
    assert "prompt_tuning_init_text go together" in problems(tiny_project, text)
    text = STAGE.format(adapter='{ use = "prompt_tuning", prompt_tuning_init = "TEXT", '
                                'prompt_tuning_init_text = "Answer:" }', steps=2, lr=0.1)
    assert "set tokenizer_name_or_path" in problems(tiny_project, text)

    # Fine: the same adapter continues in a later stage, and the adapter export writes it.
    fine = STAGE.format(adapter='"prompt_tuning"', steps=2, lr=0.1) + \
        STAGE.format(adapter='"prompt_tuning"', steps=2, lr=0.1).replace('name = "sft"', 'name = "more"') + \
        '\n[[export]]\nuse = "adapter"\n'
    assert [s.adapter.name for s in load_plan(tiny_project(fine), REGISTRY).stages] == ["prompt_tuning"] * 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="LoftQ runs where there is a CUDA GPU")
def test_loftq_without_a_gpu_is_a_clear_validation_error(tiny_project):
    message = problems(tiny_project, STAGE.format(adapter='{ use = "loftq", loftq_bits = 4 }', steps=2, lr=0.1))
    assert "stage[0].adapter: adapter 'loftq' needs a CUDA (or XPU) GPU" in message
    assert 'use adapter "pissa" or "lora"' in message
    # The same, should the plan run elsewhere than where it was validated: before peft fails obscurely.
    with pytest.raises(FtcoreError, match="needs a CUDA"):
        adapter("loftq").apply(tiny_model(), adapter_ctx())
    assert "loftq_bits" in problems(tiny_project, STAGE.format(adapter='{ use = "loftq", loftq_bits = 3 }',
                                                               steps=2, lr=0.1))


def test_prompt_tuning_starts_from_text_or_vocabulary(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "answer", "the", "question", ":"]
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>").save_pretrained(tmp_path / "tok")

    model = tiny_model()
    table = model.get_input_embeddings().weight.detach().clone()
    text = adapter("prompt_tuning", num_virtual_tokens=6, prompt_tuning_init="TEXT",
                   prompt_tuning_init_text="answer the question :", tokenizer_name_or_path=str(tmp_path / "tok"))
    prompt = text.apply(model, adapter_ctx()).prompt_encoder["default"].embedding.weight
    assert torch.equal(prompt, table[[1, 2, 3, 4, 1, 2]])  # the text's tokens, repeated to fill the prompt

    model = tiny_model()
    table = model.get_input_embeddings().weight.detach().clone()
    sampled = adapter("prompt_tuning", num_virtual_tokens=6, prompt_tuning_init="SAMPLE_VOCAB")
    prompt = sampled.apply(model, adapter_ctx()).prompt_encoder["default"].embedding.weight
    assert all(any(torch.equal(row, known) for known in table) for row in prompt)


def test_pissa_and_loftq_refuse_a_quantized_base(tiny_project):
    """Both rewrite full-precision weights when they start; a bitsandbytes quantizer loads 4-bit ones."""
    tiny_model().save_pretrained(tiny_project.dir / "base")
    for name in ("pissa", "loftq"):
        plan = tiny_project.dir / f"{name}.toml"
        plan.write_text('[model]\nuse = "hf"\npath = "base"\n\n[quantizer]\nuse = "bnb-nf4"\n\n'
                        '[data.chat]\nuse = "jsonl"\npath = "chat.jsonl"\n'
                        + STAGE.format(adapter=f'"{name}"', steps=2, lr=0.1))
        with pytest.raises(PlanError) as err:
            load_plan(plan, REGISTRY)
        assert f"stage[0].adapter: adapter '{name}' initialises from the full-precision weights and rewrites " \
               "them, which peft cannot do on quantizer 'bnb-nf4' weights" in str(err.value)


# -- freeze ------------------------------------------------------------------------------------------

def test_freeze_trains_the_last_layers_and_matching_parameters():
    model = tiny_model("llama", num_hidden_layers=3)
    adapter("freeze", trainable_layers=1, trainable_patterns=[r"^model\.norm\."]).apply(model, adapter_ctx())
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    expected = {n for n, _ in model.named_parameters() if n.startswith("model.layers.2.")} | {"model.norm.weight"}
    assert trainable == expected

    # A tied output head is found under its own name (GPT-2 ties lm_head to wte).
    gpt2 = tiny_model("gpt2")
    adapter("freeze", trainable_layers=0, trainable_patterns=["lm_head"]).apply(gpt2, adapter_ctx())
    assert [n for n, p in gpt2.named_parameters() if p.requires_grad] == ["transformer.wte.weight"]

    with pytest.raises(FtcoreError, match=r"'nope' matches no parameter; the parameters are: .*"
                                          r"model\.layers\.\*\.self_attn\.q_proj\.weight"):
        adapter("freeze", trainable_patterns=["nope"]).apply(tiny_model(), adapter_ctx())
    with pytest.raises(FtcoreError, match="trainable_layers = 5, but this model has 2 layers"):
        adapter("freeze", trainable_layers=5).apply(tiny_model(), adapter_ctx())


def test_freeze_options_are_checked(tiny_project):
    assert "nothing would train" in problems(
        tiny_project, STAGE.format(adapter='{ use = "freeze", trainable_layers = 0 }', steps=2, lr=0.1))
    assert "is not a regular expression" in problems(
        tiny_project, STAGE.format(adapter='{ use = "freeze", trainable_patterns = ["("] }', steps=2, lr=0.1))


# -- chaining: a crash between stages resumes to the same result -------------------------------------

@pytest.mark.slow
def test_resume_after_a_pissa_stage_restores_it_exactly(tiny_project):
    """pissa, then prompt tuning on the merged result. Run once; then remove the second stage's
    marker (as if the run died there) and resume: the runner restores the pissa stage from its
    saved output, merges it and trains the prompt again, to exactly the same prompt."""
    from safetensors.torch import load_file

    body = STAGE.format(adapter='{ use = "pissa", r = 4 }', steps=4, lr=3e-3).replace('name = "sft"', 'name = "a"') \
        + STAGE.format(adapter='"prompt_tuning"', steps=4, lr=0.3).replace('name = "sft"', 'name = "b"') \
        + '\n[[export]]\nuse = "adapter"\n'
    plan = tiny_project(body)
    run_plan(plan)
    run = tiny_project.dir / "runs" / "tiny"
    first = load_file(run / "exports" / "adapter" / "adapter_model.safetensors")
    shutil.rmtree(run / "stages" / "b")

    run_plan(plan, resume=True)
    assert "stage a is complete: restored its output" in (run / "run.log").read_text()
    again = load_file(run / "exports" / "adapter" / "adapter_model.safetensors")
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
