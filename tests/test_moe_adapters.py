"""LoRA on mixture-of-experts models. transformers 5 stores most families' routed experts as fused 3-D
parameters (``mlp.experts.gate_up_proj``), not linear layers: the default preset adapts them through peft's
``target_parameters``, and every other linear layer as before, routers and gates left frozen; the targets
line and the trainable count the stage prints are what peft adapted, and what adapter_config.json says;
training moves the experts, the merge folds them in, plain peft reloads the adapter; the rank bound ignores
1-wide and head-wide gates; a wrong ``target_parameters`` entry is one line listing what may be named."""

from __future__ import annotations

import copy
import json
import re

import pytest

from ftcore.errors import FtcoreError
from ftcore.plugins import get_plugin_manager
from ftcore.testing import RecordingReporter

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

PM = get_plugin_manager(entry_points=False)
REGISTRY = PM.registry()

SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             intermediate_size=64, vocab_size=128, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)
MOE = dict(num_experts_per_tok=2)
# model_type: its config fields (4 routed experts each)
FAMILIES = {
    "qwen3_moe": dict(MOE, num_experts=4, moe_intermediate_size=16),
    "qwen2_moe": dict(MOE, num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=32),
    "mixtral": dict(MOE, num_local_experts=4),
    "gpt_oss": dict(MOE, num_local_experts=4, layer_types=["sliding_attention", "full_attention"]),
    "olmoe": dict(MOE, num_experts=4),
    # Layer 0 a dense MLP, layer 1 routed and shared experts; multi-head latent attention.
    "deepseek_v3": dict(MOE, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=16,
                        first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=16, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
    # A gated DeltaNet layer, then full attention; heads of 16 as the real model's are wider than its
    # per-head gate projection (in_proj_ba: 2 values per value head, 8 wide here, 64 in Qwen3-Next-80B).
    "qwen3_next": dict(MOE, head_dim=16, num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                       layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
                       linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16),
}
# Routers and gates (module names): never adapted by a preset.
GATES = ("gate", "router", "shared_expert_gate")
HEAD_WIDE = {"qwen3_next": ["in_proj_ba"]}


def available(model_type: str) -> None:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type} model")


def tiny_moe(model_type: str, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    available(model_type)
    config = AutoConfig.for_model(model_type, **{**SIZES, **FAMILIES[model_type]})
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def adapter(name: str, **options):
    reg = REGISTRY.resolve("adapter", name)
    return reg.cls(reg.cls.Options(**options))


def apply(component, model):
    from ftcore.context import AdapterContext

    reporter = RecordingReporter()
    return component.apply(model, AdapterContext(None, reporter, None)), reporter


def train_steps(model, ids, steps: int) -> list[float]:
    """``steps`` AdamW steps (lr 1e-2) of the model's own loss on ``ids``, in train mode: the losses."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def printed(reporter, name: str = "lora") -> tuple[list[str], int, list[str], int, int]:
    """From the stage's lines: target_modules and how many layers, target_parameters and how many
    tensors, and the trainable count."""
    line = next(m for m in reporter.infos if m.startswith(f"adapter {name}: targets "))
    found = re.match(rf"adapter {name}: targets (.*?) \((\d+) layers\)(?:; parameters (.*?) \((\d+) tensors[^)]*\))?",
                     line)
    assert found, line
    count = next(re.search(r"([\d,]+) trainable parameters of", m) for m in reporter.infos if "trainable" in m)
    return (found[1].split(", "), int(found[2]), found[3].split(", ") if found[3] else [], int(found[4] or 0),
            int(count[1].replace(",", "")))


def gates(model, model_type: str) -> list[str]:
    return [p for p, _ in model.named_modules()
            if p.rsplit(".", 1)[-1] in (*GATES, *HEAD_WIDE.get(model_type, []))]


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_default_lora_adapts_the_routed_experts_and_says_what_it_adapted(model_type, tmp_path):
    base = tiny_moe(model_type)
    experts = [n for n, p in base.named_parameters() if p.dim() == 3 and ".experts." in n]
    assert experts, "the routed experts are stored as 3-D parameters in this transformers"
    frozen = gates(base, model_type)
    assert frozen
    heads = {p for p, m in base.named_modules() if m is base.get_output_embeddings()}
    linear = [p for p, m in base.named_modules() if isinstance(m, torch.nn.Linear) and p not in heads
              and not any(p == g or p.startswith(g + ".") for g in frozen)]

    component = adapter("lora", r=4)
    model, reporter = apply(component, copy.deepcopy(base))
    tuner = model.base_model
    modules, parameters = set(tuner.targeted_module_names), set(tuner.targeted_parameter_names)

    # (1) Every routed expert tensor has its LoRA matrices, and every other linear layer (attention, a dense
    # MLP, the shared experts) is adapted too: as a layer, or where peft's transformers-5 conversion would take
    # its name for the experts', as its weight.
    assert set(experts) <= parameters
    for path in experts:
        module = path.rsplit(".", 1)[0]
        assert any(n.startswith(f"base_model.model.{module}.") and "lora_A" in n and p.requires_grad and p.numel()
                   for n, p in model.named_parameters()), path
    assert all(p in modules or f"{p}.weight" in parameters for p in linear)
    # (3) Routers and gates get none.
    assert not [t for t in modules | parameters if any(t == g or t.startswith(g + ".") for g in frozen)]

    # (2) What the stage prints is what peft adapted, and what the saved adapter says.
    names, layers, parameter_names, tensors, trainable = printed(reporter)
    assert trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    assert (layers, tensors) == (len(modules), len(parameters))
    component.save(model, tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (names, parameter_names) == (saved["target_modules"], saved["target_parameters"])
    assert not saved["rank_pattern"]  # every target at r, none doubled by peft's conversion

    # (4) A few steps train the experts; the merge folds them in; plain peft reloads the adapter.
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    losses = train_steps(model, ids, 4)
    assert losses[-1] < losses[0], losses
    model.eval()
    with torch.no_grad():
        trained = model(input_ids=ids).logits
    component.save(model, tmp_path / "trained")
    merged = component.merge(copy.deepcopy(model)).eval()
    weights, before = dict(merged.named_parameters()), dict(base.named_parameters())
    for path in experts:
        assert weights[path].shape == before[path].shape and not torch.allclose(weights[path], before[path]), path
    for path in frozen:
        for name, value in base.get_submodule(path).named_parameters():
            assert torch.equal(weights[f"{path}.{name}"], value), f"{path}.{name}"
    with torch.no_grad():
        assert (merged(input_ids=ids).logits - trained).abs().max() < 1e-5

    from peft import PeftModel

    reloaded = PeftModel.from_pretrained(tiny_moe(model_type), tmp_path / "trained").eval()
    with torch.no_grad():
        assert torch.allclose(reloaded(input_ids=ids).logits, trained, atol=1e-6)


def test_one_wide_and_head_wide_gates_neither_train_nor_bound_the_rank():
    """Qwen3-Next's shared_expert_gate (hidden x 1) and in_proj_ba (2 values per head) refused every rank
    above 1 when all-linear chose them; left out, r = 16 is accepted, bounded by the narrowest real target."""
    model, reporter = apply(adapter("lora", r=16), tiny_moe("qwen3_next"))
    adapted = set(model.base_model.targeted_module_names) | set(model.base_model.targeted_parameter_names)
    assert not [t for t in adapted if "shared_expert_gate" in t or "in_proj_ba" in t]
    assert any("in_proj_qkvz" in t for t in adapted) and any("experts.gate_up_proj" in t for t in adapted)
    assert "shared_expert_gate x2 (1 wide)" in reporter.infos[0] and "in_proj_ba x1 (8 wide, per head)" in \
        reporter.infos[0]
    with pytest.raises(FtcoreError, match=r"^adapter r: 17 is more than the smaller dimension of the targeted "
                                          r"layers \(.*: 32 x 16\)"):
        apply(adapter("lora", r=17), tiny_moe("qwen3_next"))
    # An expert parameter bounds the rank by one expert's matrix.
    with pytest.raises(FtcoreError, match=r"\(experts.down_proj: 32 x 16 per expert\).*use at most 16"):
        apply(adapter("lora", r=17, target_modules="mlp"), tiny_moe("qwen3_moe"))
    # Named explicitly, a gate is adapted like any layer (and bounds the rank).
    model, _ = apply(adapter("lora", r=1, target_modules=["shared_expert_gate"]), tiny_moe("qwen3_next"))
    assert sorted(model.base_model.targeted_module_names) == ["model.layers.0.mlp.shared_expert_gate",
                                                               "model.layers.1.mlp.shared_expert_gate"]


def test_target_parameters_names_parameters_and_a_wrong_one_lists_them():
    model, reporter = apply(adapter("lora", r=4, target_modules=["q_proj"], target_parameters=["experts.down_proj"]),
                            tiny_moe("qwen3_moe"))
    assert sorted(model.base_model.targeted_parameter_names) == ["model.layers.0.mlp.experts.down_proj",
                                                                  "model.layers.1.mlp.experts.down_proj"]
    assert printed(reporter)[:4] == (["q_proj"], 2, ["experts.down_proj"], 2)
    # [] leaves the experts frozen under a preset.
    model, reporter = apply(adapter("lora", r=4, target_parameters=[]), tiny_moe("qwen3_moe"))
    assert not model.base_model.targeted_parameter_names and printed(reporter)[2] == []

    for entry, why in (("gate_up", "matches no parameter"), ("q_proj.weight", "names a parameter of a linear layer")):
        with pytest.raises(FtcoreError) as err:
            apply(adapter("lora", target_parameters=["experts.gate_up_proj", entry]), tiny_moe("qwen3_moe"))
        message = str(err.value)
        assert "\n" not in message and message.startswith(f"adapter target_parameters: {entry!r} {why}")
        assert message.endswith("in this qwen3_moe model; the parameters it may name are: experts.gate_up_proj, "
                                "experts.down_proj, gate.weight")
    # Naming the experts as modules says where they go.
    with pytest.raises(FtcoreError, match=r"^adapter target_modules: 'gate_up_proj' matches no module in this "
                                          r"qwen3_moe model; its linear layers are: q_proj, k_proj, v_proj, o_proj, "
                                          r"lm_head; its experts are parameters \(experts.gate_up_proj, "
                                          r"experts.down_proj\): name them in target_parameters$"):
        apply(adapter("lora", target_modules=["gate_up_proj"]), tiny_moe("qwen3_moe"))


def test_what_peft_cannot_do_on_parameters_is_one_line():
    """peft's ParamWrapper has no DoRA, no dropout, and PiSSA/OLoRA read a weight matrix an experts module
    has not; rsLoRA and LoRA+ work."""
    for name, options, key in (("dora", {}, "target_parameters"), ("pissa", {}, "target_parameters"),
                               ("olora", {}, "target_parameters"), ("lora", {"lora_dropout": 0.1}, "lora_dropout")):
        with pytest.raises(FtcoreError) as err:
            apply(adapter(name, **options), tiny_moe("qwen3_moe"))
        assert "\n" not in str(err.value) and str(err.value).startswith(f"adapter {key}: ")
        assert "(experts.gate_up_proj, experts.down_proj)" in str(err.value)
    # On DeepSeek-V3 the dense MLP's names are handed to peft as weights: DoRA cannot take those either.
    with pytest.raises(FtcoreError, match="^adapter target_modules: dora cannot adapt parameters .* gate_proj, "
                                          "up_proj, down_proj, which peft adapts as parameters on this model"):
        apply(adapter("dora", target_parameters=[]), tiny_moe("deepseek_v3"))
    model, _ = apply(adapter("dora", r=4, target_parameters=[]), tiny_moe("qwen3_moe"))
    assert not model.base_model.targeted_parameter_names
    for name in ("rslora", "loraplus"):
        model, _ = apply(adapter(name, r=4), tiny_moe("qwen3_moe"))
        assert len(model.base_model.targeted_parameter_names) == 4
    # IA3 scales modules only: it says the experts stay frozen.
    model, reporter = apply(adapter("ia3"), tiny_moe("qwen3_moe"))
    assert reporter.warnings == ["adapter ia3: this model's experts are parameters (experts.gate_up_proj, "
                                 "experts.down_proj), which IA3 cannot scale: they stay frozen; adapter \"lora\" "
                                 "adapts them"]


# -- through a plan: SFT, then the merged and adapter exports ---------------------------------------

PLAN = """
[[stage]]
name = "sft"
trainer = "sft"
data = "chat"
adapter = {{ use = "lora", r = 4 }}
max_steps = 6
batch_size = 8
max_length = 64
learning_rate = 3e-3
logging_steps = 1
save_steps = 1000

[[export]]
use = "adapter"

[[export]]
use = "merged"
tolerance = 1e-5
"""
SCRATCH = {
    "qwen3_moe": 'architecture = "qwen3_moe"\nnum_layers = 2\nnum_heads = 4\nnum_kv_heads = 2\n'
                 "config = { num_experts = 4, num_experts_per_tok = 2, moe_intermediate_size = 16, head_dim = 8 }",
    "deepseek_v3": 'architecture = "deepseek_v3"\nnum_layers = 2\nnum_heads = 4\n'
                   "config = { n_routed_experts = 4, n_shared_experts = 1, num_experts_per_tok = 2, "
                   "moe_intermediate_size = 16, first_k_dense_replace = 1, n_group = 1, topk_group = 1, "
                   "q_lora_rank = 16, kv_lora_rank = 16, qk_rope_head_dim = 8, qk_nope_head_dim = 8, v_head_dim = 8 }",
}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", list(SCRATCH))
def test_moe_lora_trains_and_exports_through_a_plan(model_type, tiny_project):
    """The merged export's check holds at 1e-5, its expert tensors moved, and the adapter export loads in
    plain peft on the saved base and gives the merged model's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ftcore.plan import load_plan
    from ftcore.runner import Runner

    available(model_type)
    plan = tiny_project(PLAN.format())
    plan.write_text(plan.read_text().replace("num_layers = 1\nnum_heads = 2", SCRATCH[model_type]))
    Runner(load_plan(plan, REGISTRY), PM, None).run()
    run = tiny_project.dir / "runs" / "tiny"
    log = (run / "run.log").read_text()
    assert "merged: merge verified" in log and "experts.gate_up_proj, experts.down_proj" in log

    base = AutoModelForCausalLM.from_pretrained(run / "model" / "base", dtype=torch.float32).eval()
    merged = AutoModelForCausalLM.from_pretrained(run / "exports" / "merged", dtype=torch.float32).eval()
    weights = dict(merged.named_parameters())
    experts = [n for n, p in base.named_parameters() if p.dim() == 3 and ".experts." in n]
    assert experts and all(not torch.allclose(weights[n], p) for n, p in base.named_parameters() if n in experts)
    config = json.loads((run / "exports" / "adapter" / "adapter_config.json").read_text())
    assert config["target_parameters"][-2:] == ["experts.gate_up_proj", "experts.down_proj"]
    reloaded = PeftModel.from_pretrained(base, run / "exports" / "adapter").eval()
    ids = torch.randint(3, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (reloaded(input_ids=ids).logits - merged(input_ids=ids).logits).abs().max() < 1e-5
