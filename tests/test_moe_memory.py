"""Mixture-of-experts models in ``ftcore estimate`` and under QLoRA (issue #42): total and active
parameters against a hand count; the routed experts, which bitsandbytes leaves at full precision, counted
as a real bnb-nf4 load holds them, said in the run's log and the estimate's notes, and trained under LoRA
on that base; Qwen3-30B-A3B's real config."""

from __future__ import annotations

import json
import logging

import pytest

from ftcore.plugins import get_plugin_manager

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from test_moe_adapters import train_steps  # noqa: E402

REGISTRY = get_plugin_manager(entry_points=False).registry()
H, LAYERS, VOCAB, E, K, MOE_I, I = 32, 2, 128, 4, 2, 16, 64  # hidden, layers, vocabulary, experts, a token, widths
SIZES = dict(hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             intermediate_size=I, vocab_size=VOCAB, max_position_embeddings=128, num_experts_per_tok=K,
             pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
FAMILIES = {
    "qwen3_moe": dict(num_experts=E, moe_intermediate_size=MOE_I),
    "mixtral": dict(num_local_experts=E),
    # Layer 0 a dense MLP, layer 1 routed experts and a shared one; multi-head latent attention.
    "deepseek_v3": dict(num_key_value_heads=4, n_routed_experts=E, n_shared_experts=1, moe_intermediate_size=MOE_I,
                        first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=16, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
}
# The routed experts' parameters by hand: gate, up and down of each expert of each MoE layer.
ROUTED = {"qwen3_moe": LAYERS * E * 3 * MOE_I * H, "mixtral": LAYERS * E * 3 * I * H,
          "deepseek_v3": 1 * E * 3 * MOE_I * H}


def config(model_type: str):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**SIZES, **FAMILIES[model_type]})


def meta(model_type: str):
    from ftcore_plugins.common.estimate import meta_model_from_config

    c = config(model_type)
    return meta_model_from_config(c, torch.float32), c


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_active_parameters_are_the_rest_and_a_tokens_share_of_the_routed_experts(model_type):
    from ftcore_plugins.common.estimate import moe_parameters

    model, c = meta(model_type)
    moe = moe_parameters(model, c)
    total = sum(p.numel() for p in model.parameters())
    routed = ROUTED[model_type]
    assert moe == {"total": total, "active": total - routed + routed * K // E, "routed": routed, "per_token": K,
                   "experts": E}
    if model_type == "qwen3_moe":  # the whole model by hand too
        attention = H * 32 + 2 * H * 16 + 32 * H + 2 * 8  # q, k, v, o (4 heads, 2 key-value heads of 8), q/k norms
        layer = attention + E * H + 2 * H  # the router, two norms
        assert total == LAYERS * layer + routed + 2 * VOCAB * H + H  # embeddings, head, final norm
    # A dense model has none.
    from ftcore_plugins.common.estimate import meta_model_from_config

    dense = transformers.AutoConfig.for_model("llama", **{k: v for k, v in SIZES.items() if k != "num_experts_per_tok"})
    assert moe_parameters(meta_model_from_config(dense, torch.float32), dense) is None


def plan(folder, model: str, quantizer: str = "") -> object:
    from ftcore.plan import load_plan

    (folder / "rows.jsonl").write_text("")
    path = folder / "plan.toml"
    path.write_text(f'[model]\nuse = "hf"\npath = "{model}"\n\n{quantizer}\n\n[adapter]\nuse = "lora"\nr = 4\n\n'
                    '[data.rows]\nuse = "jsonl"\npath = "rows.jsonl"\n\n'
                    '[[stage]]\ntrainer = "sft"\ndata = "rows"\nbatch_size = 1\nmax_length = 64\n')
    return load_plan(path, REGISTRY)


def test_the_estimate_reports_total_and_active_parameters_and_times_the_active_ones(tmp_path):
    from ftcore_plugins.commands.estimate import Estimate, estimate_plan, stage_line

    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / "config.json").write_text(config("qwen3_moe").to_json_string())
    result = estimate_plan(plan(tmp_path, "moe"), device="cpu")
    s = result.stages[0]
    model, _ = meta("qwen3_moe")
    total = sum(p.numel() for p in model.parameters())
    active = total - ROUTED["qwen3_moe"] + ROUTED["qwen3_moe"] * K // E
    assert (s.moe["total"], s.moe["active"]) == (total, active)
    assert stage_line(result, s).endswith(f"; mixture of experts: {total:,} parameters, {active:,} active per token "
                                          f"({K} of {E} routed experts)")
    params = Estimate.to_json(result)["stages"][0]["params"]
    assert params["model"] == total and params["active"] == active and params["total"] > total  # the LoRA's
    assert (params["experts_per_token"], params["experts"]) == (K, E)
    # A token multiplies the active weights (all but the input embedding): the time estimate's N.
    assert s.compute_params == active - VOCAB * H


# -- QLoRA ----------------------------------------------------------------------------------------------
def quantizer(**options):
    reg = REGISTRY.resolve("quantizer", "bnb-nf4")
    return reg.cls(reg.cls.Options(**options))


def held_bytes(model) -> int:
    """What the loaded model holds: every parameter and buffer, and each 4-bit weight's quantization state."""
    def state(qs) -> int:
        if qs is None:
            return 0
        tensors = [getattr(qs, name, None) for name in ("absmax", "code", "offset")]
        return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t)) + state(qs.state2)

    return sum(p.numel() * p.element_size() + state(getattr(p, "quant_state", None)) for p in model.parameters()) + \
        sum(b.numel() * b.element_size() for b in model.buffers())


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A bf16 qwen3_moe checkpoint, as the real ones are stored."""
    folder = tmp_path_factory.mktemp("qwen3-moe") / "model"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config("qwen3_moe"), dtype=torch.bfloat16)
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("fp32", [None, False])
def test_bnb_leaves_the_experts_at_full_precision_the_estimate_counts_what_the_load_holds_and_lora_trains(
        tiny_checkpoint, fp32, caplog):
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb

    from ftcore.context import AdapterContext
    from ftcore.testing import RecordingReporter
    from ftcore_plugins.adapters._targets import expert_parameters

    q = quantizer(fp32_non_quantized=fp32)
    loader = REGISTRY.resolve("model loader", "hf")
    meta_model, _ = loader.cls(loader.cls.Options(path=str(tiny_checkpoint))).meta_model()
    meta_model = q.prepare_meta(meta_model, device="cpu")
    predicted = q.weight_bytes(meta_model)

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, **q.load_kwargs())
    with caplog.at_level(logging.INFO, logger="ftcore"):
        model = q.prepare(model)
    experts = expert_parameters(model)
    dtype = torch.float32 if fp32 is None else torch.bfloat16  # this machine's default (CPU) upcasts them
    assert experts and {p.dtype for p in experts.values()} == {dtype}
    assert sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules()) == LAYERS * 4  # attention only
    # The estimate's count is what the load holds, but for each 4-bit layer's 16-value code book and offset.
    assert 0 <= held_bytes(model) - predicted <= LAYERS * 4 * (16 * 4 + 4)
    size = ROUTED["qwen3_moe"] * (4 if fp32 is None else 2)
    line = (f"quantizer 'bnb-nf4': the routed experts ({ROUTED['qwen3_moe']:,} parameters in {LAYERS * 2} tensors, "
            f"{size / 2**30:.2f} GiB) stay in {str(dtype)[6:]}")
    assert [r.getMessage() for r in caplog.records if "routed experts" in r.getMessage()] == [
        line + ": transformers' bitsandbytes integration quantizes linear layers only"]
    assert q.weight_notes(meta_model) == [line + ", and are counted so: transformers' bitsandbytes integration "
                                                 "quantizes linear layers only"]

    # LoRA on the experts trains on that base.
    lora = REGISTRY.resolve("adapter", "lora")
    model = lora.cls(lora.cls.Options(r=4)).apply(model, AdapterContext(None, RecordingReporter(), q))
    assert len(model.base_model.targeted_parameter_names) == LAYERS * 2
    trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad and ".experts." in n}
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    losses = train_steps(model, ids, 3)
    assert losses[-1] < losses[0], losses
    moved = [n for n, p in model.named_parameters() if n in trained and not torch.equal(p, trained[n])]
    assert len(moved) == len(trained) == LAYERS * 2 * 2  # A and B of both expert tensors of each layer


# Qwen/Qwen3-30B-A3B's config.json
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936}


def test_qwen3_30b_a3b_under_bnb_nf4_counts_its_experts_at_their_dtype(tmp_path):
    """30.5B parameters, 3.3B active; nf4 quantizes the attention's 0.9B only: the experts stay in the
    checkpoint's bf16 on CUDA (54 GiB) and are upcast with the other unquantized weights on CPU."""
    from ftcore_plugins.common.estimate import moe_parameters

    (tmp_path / "qwen3-30b-a3b").mkdir()
    (tmp_path / "qwen3-30b-a3b" / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    loader = REGISTRY.resolve("model loader", "hf")
    model, c = loader.cls(loader.cls.Options(path=str(tmp_path / "qwen3-30b-a3b"))).meta_model()
    h, layers, experts, moe_i, vocab = 2048, 48, 128, 768, 151936
    routed = layers * experts * 3 * moe_i * h
    attention = layers * (h * 4096 + 2 * h * 512 + 4096 * h)  # q, k, v, o: the linear layers nf4 quantizes
    rest = layers * (2 * 128 + experts * h + 2 * h) + 2 * vocab * h + h  # q/k norms, router, norms; embeddings, head
    assert moe_parameters(model, c) == {"total": routed + attention + rest, "active": attention + rest + routed // 16,
                                        "routed": routed, "per_token": 8, "experts": experts}
    assert (routed + attention + rest, attention + rest + routed // 16) == (30_532_122_624, 3_353_032_704)

    q = quantizer()
    cuda = q.weight_bytes(q.prepare_meta(model, device="cuda"))  # bf16 kept (fp32_non_quantized's CUDA default)
    cpu = q.weight_bytes(q.prepare_meta(model, device="cpu"))  # upcast to fp32, as prepare() on CPU does
    assert cpu - cuda == 2 * (routed + rest)
    four_bit = cuda - 2 * (routed + rest) - sum(b.numel() * b.element_size() for b in model.buffers())  # rotary's
    assert 0.5 * attention < four_bit < 0.52 * attention  # 4 bits and the double-quantized constants
    assert (round(cuda / 2**30, 2), round(cpu / 2**30, 2), round(2 * routed / 2**30, 2)) == (55.62, 110.8, 54.0)


def test_init_says_how_many_parameters_a_token_uses(tmp_path, capsys):
    from ftcore.cli import main

    (tmp_path / "moe.json").write_text(config("qwen3_moe").to_json_string())
    (tmp_path / "data.jsonl").write_text(json.dumps({"instruction": "a", "output": "b"}) + "\n")
    model, _ = meta("qwen3_moe")
    total = sum(p.numel() for p in model.parameters())
    line = (f"{total:,} parameters, {total - ROUTED['qwen3_moe'] + ROUTED['qwen3_moe'] * K // E:,} active per token "
            f"({K} of {E} routed experts)")
    code = main(["init", "-o", str(tmp_path / "plan.toml"), "--data", str(tmp_path / "data.jsonl"), "--model",
                 "org/moe", "--config", str(tmp_path / "moe.json"), "--gpu-memory", "0", "--kind", "instructions",
                 "--goal", "task"])
    assert code == 0
    assert f"; mixture of experts: {line}; check it with" in capsys.readouterr().out
    assert f"# Mixture of experts: {line}.\n" in (tmp_path / "plan.toml").read_text()


# -- LoRA on expert parameters --------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["grouped", "peft"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_estimate_counts_what_the_expert_lora_saves_for_backward(dtype, path):
    """ftcore's grouped path (what the lora adapter runs) keeps, beyond the experts' inputs, the rank-r intermediates
    and B in the experts' layout (A too where cast to a 16-bit model's dtype, or padded: r=4 runs at 8 in bf16), never
    a copy of the expert stack. peft's own path (ftcore's grouped forward off) reads an adapted expert tensor as
    W + s B A for every expert at once, and the experts' matmuls save that copy for backward (with the fp32 factors'
    copies in a 16-bit model's dtype). The estimate counts what each adapted tensor keeps (all layers' without
    checkpointing) and leaves the wrappers' factors out of the per-layer LoRA count."""
    from ftcore.context import AdapterContext
    from ftcore.testing import RecordingReporter
    from ftcore_plugins.common.expert_lora import disable
    from ftcore_plugins.common.estimate import _scan, expert_lora_bytes

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config("qwen3_moe"), dtype=dtype)
    lora = REGISTRY.resolve("adapter", "lora")
    model = lora.cls(lora.cls.Options(r=4, target_modules=["q_proj"], target_parameters=["experts.gate_up_proj",
                                                                                      "experts.down_proj"])).apply(
        model, AdapterContext(None, RecordingReporter(), None))
    if path == "peft":
        disable(model)
    found = _scan(model, autocast=False)
    size = 4 if dtype == torch.float32 else 2
    gate_up, down = E * 2 * MOE_I * H * size, E * H * MOE_I * size
    if path == "grouped":
        r = 4 if dtype == torch.float32 else 8
        a = 0 if dtype == torch.float32 else 1  # A cast (and padded) to bf16 too
        kept = [E * r * (2 * MOE_I + a * H) * size, E * r * (H + a * MOE_I) * size]
        assert found["expert_blocks"] == [[(0, kept[0]), (0, kept[1])]] * LAYERS
        assert found["expert_inputs"] == K * (H + MOE_I + 2 * r) * size * LAYERS  # inputs and intermediates
    else:
        cast = 0 if dtype == torch.float32 else size  # the fp32 factors' copies, per factor element
        kept = [gate_up + cast * E * 4 * (H + 2 * MOE_I), down + cast * E * 4 * (MOE_I + H)]
        assert found["expert_blocks"] == [[(gate_up, kept[0]), (down, kept[1])]] * LAYERS
        assert found["expert_inputs"] == K * (H + MOE_I) * size * LAYERS  # each input, once per routed expert
    assert found["adapted"] == [(f"base_model.model.model.layers.{i}.self_attn", "attn_in", H, 4)
                                for i in range(LAYERS)]  # the experts' factors are not linear layers' LoRA

    existing = {p.untyped_storage().data_ptr() for p in model.parameters()}
    copies: dict[int, int] = {}

    def pack(t):  # new tensors with one slice per expert: the copies (or their transposes)
        if t.dim() == 3 and t.shape[0] == E and t.untyped_storage().data_ptr() not in existing:
            copies[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids).loss.backward()
    assert sum(copies.values()) == LAYERS * sum(kept)
    # Backward adds each copy's gradient on peft's path: the last layer's, then with checkpointing a single layer's.
    grads = [0, 0] if path == "grouped" else [gate_up, down]
    assert expert_lora_bytes(found["expert_blocks"], False) == (LAYERS - 1) * sum(kept) + max(
        kept[0] + grads[0], sum(kept) + grads[1])
    assert expert_lora_bytes(found["expert_blocks"], True) == max(kept[0] + grads[0], sum(kept) + grads[1])
