"""ftcore's grouped path for LoRA on fused expert parameters (plugins/common/expert_lora.py): on every family
whose experts transformers fuses, it computes what peft's own path computes (output, loss, the gradients of the
input and of the factors, a few AdamW steps, the merge) without saving a copy of the expert stack for backward;
where it cannot run, peft's path runs and a debug log says why; a restored adapter and the estimate's meta model
run it too; a saved adapter still loads in plain peft."""

from __future__ import annotations

import copy
import logging

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("transformers")

from test_moe_adapters import SIZES, adapter, apply, tiny_moe, train_steps  # noqa: E402

from ftcore_plugins.common import expert_lora  # noqa: E402

FUSED = ["qwen3_moe", "mixtral", "gpt_oss", "qwen2_moe", "olmoe", "deepseek_v3"]
IDS = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))


def lora_model(model_type: str, **options):
    """The tiny model under ftcore's lora adapter (r=4 unless given), every lora_B set nonzero (a fixed draw)."""
    model, _ = apply(adapter("lora", **{"r": 4, **options}), tiny_moe(model_type))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def expert_wrappers(model) -> list:
    from peft.tuners.lora import ParamWrapper

    return [m for m in model.modules() if isinstance(m, ParamWrapper) and m.get_param().dim() == 3]


def peft_path(model):
    """A copy of ``model`` running peft's own path (ftcore's grouped forward switched off)."""
    other = copy.deepcopy(model)
    expert_lora.disable(other)
    assert not any(expert_lora.runs_grouped(w) for w in expert_wrappers(other))
    return other


def step(model):
    """One forward and backward on IDS: logits, loss, the gradients (of the input embeddings and of every trainable
    parameter), and the shapes of the whole-stack tensors the forward saved for backward: new 3-D tensors with one
    slice per expert and at least as many elements as the smallest adapted expert tensor (``W + s B A``)."""
    stacks = [w.get_param() for w in expert_wrappers(model)]
    experts, smallest = stacks[0].shape[0], min(p.numel() for p in stacks)
    existing = {p.untyped_storage().data_ptr() for p in model.parameters()}
    copies = []

    def pack(t):
        if t.dim() == 3 and t.shape[0] == experts and t.numel() >= smallest and \
                t.untyped_storage().data_ptr() not in existing:
            copies.append(tuple(t.shape))
        return t

    model.zero_grad()
    embeds = model.get_input_embeddings()(IDS).detach().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(inputs_embeds=embeds, labels=IDS)
    out.loss.backward()
    grads = {"input": embeds.grad, **{n: p.grad for n, p in model.named_parameters() if p.requires_grad}}
    return out.logits.detach(), out.loss.item(), grads, copies


def close(a, b, tol=1e-5) -> float:
    diff = (a - b).abs().max().item()
    assert diff <= tol, diff
    return diff


@pytest.mark.parametrize("model_type", FUSED)
def test_the_grouped_path_computes_what_peft_does_without_a_copy_of_the_experts(model_type):
    model = lora_model(model_type)
    wrappers = expert_wrappers(model)
    assert wrappers and all(expert_lora.runs_grouped(w) for w in wrappers)
    reference = peft_path(model)

    # (1) Output, loss, the input's and every factor's gradient (fp32), and no whole-stack copy saved for backward
    # (peft's path saves one a tensor).
    logits, loss, grads, copies = step(model)
    peft_logits, peft_loss, peft_grads, peft_copies = step(reference)
    assert copies == [] and len(peft_copies) >= len(wrappers)
    close(logits, peft_logits)
    assert loss == pytest.approx(peft_loss, abs=1e-5)
    assert grads.keys() == peft_grads.keys() and any(".experts." in n and "lora_A" in n for n in grads)
    for name in grads:
        close(grads[name], peft_grads[name])

    # (2) A few AdamW steps: the same losses, the same factors (to 1e-4: Adam's steps, 1e-2 each, normalize away how
    # small a gradient is, so float rounding in a near-zero one moves its element by up to a few 1e-5).
    losses, peft_losses = train_steps(model, IDS, 3), train_steps(reference, IDS, 3)
    assert losses == pytest.approx(peft_losses, abs=1e-5) and losses[-1] < losses[0], (losses, peft_losses)
    trained = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        if p.requires_grad:
            close(p, trained[name], 1e-4)

    # (3) The merge equals the grouped forward, and leaves transformers' own experts forward.
    model.eval()
    with torch.no_grad():
        live = model(input_ids=IDS).logits
    merged = adapter("lora", r=4).merge(copy.deepcopy(model)).eval()
    assert merged.config._experts_implementation == "grouped_mm"
    with torch.no_grad():
        close(merged(input_ids=IDS).logits, live)
    # Adapters disabled: the base model's output (its weights are tiny_moe's, frozen).
    with torch.no_grad(), model.disable_adapter():
        close(model(input_ids=IDS).logits, tiny_moe(model_type)(input_ids=IDS).logits, 1e-6)


def test_a_rank_the_grouped_matmul_cannot_take_is_padded():
    """torch's grouped_mm wants the rank-r rows 16-byte aligned: r=2 in fp32 runs at 4, zero-padded, and computes
    what peft does."""
    model = lora_model("qwen3_moe", r=2)
    assert expert_lora.padded_rank(2, torch.float32) == 4 and expert_lora.padded_rank(4, torch.bfloat16) == 8
    logits, _, grads, copies = step(model)
    peft_logits, _, peft_grads, _ = step(peft_path(model))
    assert copies == []
    close(logits, peft_logits)
    for name in grads:
        close(grads[name], peft_grads[name])


def test_where_the_grouped_path_cannot_run_peft_runs_and_a_debug_line_says_why(caplog):
    from peft import LoraConfig

    def fell_back(why: str) -> None:
        messages = [r.getMessage() for r in caplog.records if "runs peft's path" in r.getMessage()]
        assert any(why in m for m in messages), messages

    expert_lora._said.clear()
    caplog.set_level(logging.DEBUG, logger="ftcore")

    # Two adapters active at once: peft sums their deltas into the weight.
    model = lora_model("qwen3_moe")
    alone = step(model)[0]
    model.add_adapter("second", LoraConfig(r=4, target_modules=["q_proj"], target_parameters=[
        "experts.gate_up_proj", "experts.down_proj"], init_lora_weights=True))  # B = 0: no change to the output
    model.base_model.set_adapter(["default", "second"])
    assert not any(expert_lora.runs_grouped(w) for w in expert_wrappers(model))
    logits, _, _, copies = step(model)
    assert copies
    close(logits, alone)
    fell_back("2 adapters active")

    # An experts implementation chosen on purpose stays: peft's path over it.
    base = tiny_moe("qwen3_moe")
    base.set_experts_implementation("batched_mm")
    model, _ = apply(adapter("lora", r=4), base)
    assert model.config._experts_implementation == "batched_mm"
    assert not any(expert_lora.runs_grouped(w) for w in expert_wrappers(model))
    fell_back("the experts run transformers' 'batched_mm' implementation")

    # Experts that are not transformers' use_experts_implementation kind (JetMoE's): peft's path.
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("jetmoe", **{**SIZES, "num_local_experts": 4, "num_experts_per_tok": 2,
                                               "kv_channels": 8, "num_key_value_heads": 4})
    model, _ = apply(adapter("lora", r=4), AutoModelForCausalLM.from_config(config))
    assert expert_wrappers(model) and expert_lora.enable(model) == 0
    fell_back("JetMoeParallelExperts is not an experts module of transformers' use_experts_implementation")

    # Expert parallel, float8 weights.
    model = lora_model("qwen3_moe")
    wrapper = expert_wrappers(model)[0]
    experts = wrapper.get_base_layer()
    experts._is_expert_parallel = True
    assert expert_lora.why_not(wrapper) == "the experts are split across devices (expert parallel)"
    experts._is_expert_parallel = False
    name = wrapper.parameter_name
    weight = getattr(experts, name)
    setattr(experts, name, torch.nn.Parameter(weight.detach().to(torch.float8_e4m3fn), requires_grad=False))
    assert expert_lora.why_not(wrapper).startswith("its weights are float8_e4m3fn")
    setattr(experts, name, weight)
    assert expert_lora.why_not(wrapper) is None


def test_a_restored_adapter_and_the_estimates_meta_model_run_it_and_plain_peft_loads_the_adapter(tmp_path):
    from peft import PeftModel

    from ftcore.context import AdapterContext
    from ftcore.testing import RecordingReporter

    component = adapter("lora", r=4)
    model = lora_model("qwen3_moe").eval()
    with torch.no_grad():
        live = model(input_ids=IDS).logits
    component.save(model, tmp_path / "adapter")
    restored = component.restore(tiny_moe("qwen3_moe"), tmp_path / "adapter", AdapterContext(None, RecordingReporter(),
                                                                                             None)).eval()
    assert all(expert_lora.runs_grouped(w) for w in expert_wrappers(restored))
    plain = PeftModel.from_pretrained(tiny_moe("qwen3_moe"), tmp_path / "adapter").eval()  # no ftcore: peft's path
    assert not any(expert_lora.runs_grouped(w) for w in expert_wrappers(plain))
    with torch.no_grad():
        close(restored(input_ids=IDS).logits, live)
        close(plain(input_ids=IDS).logits, live)

    with torch.device("meta"):
        meta = tiny_moe("qwen3_moe")
    meta = component.apply_meta(meta, AdapterContext(None, RecordingReporter(), None))
    assert expert_wrappers(meta) and all(expert_lora.runs_grouped(w) for w in expert_wrappers(meta))
