"""LoRA on hybrid models (Mamba, gated DeltaNet or short-convolution layers beside attention). The default
preset (all-linear, r = 16) applies on every hybrid family this transformers has: it leaves out the linear
layers peft refuses on that family (``out_proj`` on nemotron_h and falcon_h1) and those whose weight the
mixer reads directly (a fused Mamba kernel's ``out_proj.weight``, Jamba's ``dt_proj.weight @ x``), which an
adapter would never reach; the rank bound counts only the layers chosen; a few steps train, and peft's
merge gives the adapted model's logits."""

from __future__ import annotations

import copy

import pytest

from ftcore.errors import FtcoreError

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from test_moe_adapters import adapter, apply, available, printed, train_steps  # noqa: E402

SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
             vocab_size=128, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# model_type: its config fields; layer 0 recurrent (Mamba, gated DeltaNet, short convolution), layer 1 attention.
LINEAR_ATTENTION = dict(head_dim=16, layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
                        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)
FAMILIES = {
    "qwen3_next": dict(LINEAR_ATTENTION, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32),
    "qwen3_5_text": LINEAR_ATTENTION,
    "nemotron_h": dict(head_dim=16, layers_block_type=["mamba", "attention"], mamba_num_heads=4, mamba_head_dim=16,
                       n_groups=1, ssm_state_size=16, chunk_size=16),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"], num_local_experts=4, num_experts_per_tok=2,
                             shared_intermediate_size=64, mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16,
                             mamba_chunk_size=16),
    # Every layer holds attention and a Mamba mixer side by side.
    "falcon_h1": dict(head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16,
                      mamba_chunk_size=16),
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    # dt_proj is 8 x 128: narrower than r = 16, which it must not bound as it is left out.
    "jamba": dict(num_experts=4, num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2,
                  attn_layer_offset=1, mamba_d_state=16, mamba_dt_rank=8),
    "bamba": dict(attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_chunk_size=16),
    "zamba2": dict(layers_block_type=["mamba", "hybrid"], hybrid_layer_ids=[1], mamba_d_state=16, n_mamba_heads=4,
                   mamba_headdim=32, chunk_size=16, attention_head_dim=32, num_query_groups=4, use_mem_rope=True),
}
# What the default preset leaves out (module names), beside routers and per-head gates.
LEFT_OUT = {"nemotron_h": {"out_proj"}, "falcon_h1": {"out_proj"}, "granitemoehybrid": {"out_proj"},
            "bamba": {"out_proj"}, "zamba2": {"out_proj"}, "jamba": {"dt_proj"}}


def tiny(model_type: str, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    available(model_type)
    config = AutoConfig.for_model(model_type, **{**SIZES, **FAMILIES[model_type]})
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def mixer_layers(model, names: set[str]) -> list[str]:
    return [p for p, m in model.named_modules() if isinstance(m, torch.nn.Linear) and p.rsplit(".", 1)[-1] in names]


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_default_lora_applies_trains_and_merges_on_hybrid_models(model_type):
    base = tiny(model_type)
    component = adapter("lora", r=16)
    model, reporter = apply(component, copy.deepcopy(base))
    adapted = set(model.base_model.targeted_module_names)

    # The recurrent layers are adapted (what peft takes of them), the attention layers too.
    assert any("q_proj" in p for p in adapted) and any("in_proj" in p for p in adapted), sorted(adapted)
    left_out = mixer_layers(base, LEFT_OUT.get(model_type, set()))
    assert bool(left_out) == (model_type in LEFT_OUT) and not [p for p in left_out if p in adapted], sorted(adapted)
    line = reporter.infos[0]
    for name in LEFT_OUT.get(model_type, ()):
        assert f"{name} x" in line, line
    names, layers, _, _, trainable = printed(reporter)
    assert layers == len(adapted)
    assert trainable == sum(p.numel() for p in model.parameters() if p.requires_grad) > 0
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)

    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    losses = train_steps(model, ids, 3)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] != losses[0], losses
    model.eval()
    with torch.no_grad():
        trained = model(input_ids=ids).logits
        merged = copy.deepcopy(model).merge_and_unload().eval()
        assert (merged(input_ids=ids).logits - trained).abs().max() < 1e-5


def test_the_rank_bound_counts_only_the_layers_chosen():
    # Jamba's dt_proj (8 x 128) is left out of the preset, so r = 16 is bounded by the chosen layers...
    model, _ = apply(adapter("lora", r=16), tiny("jamba"))
    assert not [p for p in model.base_model.targeted_module_names if p.endswith("dt_proj")]
    # ... and named explicitly it is adapted like any layer, and bounds the rank.
    with pytest.raises(FtcoreError, match=r"^adapter r: 16 is more than .*\(dt_proj: 8 x 128\).*use at most 8"):
        apply(adapter("lora", r=16, target_modules=["dt_proj"]), tiny("jamba"))
    model, _ = apply(adapter("lora", r=8, target_modules=["dt_proj"]), tiny("jamba"))
    assert [p.rsplit(".", 1)[-1] for p in model.base_model.targeted_module_names] == ["dt_proj"]


def test_the_attention_preset_applies_where_peft_refuses_out_proj():
    model, _ = apply(adapter("lora", r=4, target_modules="attention"), tiny("falcon_h1"))
    adapted = model.base_model.targeted_module_names
    assert adapted and all(".self_attn." in p for p in adapted), adapted
