"""The model coverage matrix (docs/models.md): for each model type a user fine-tunes today, a tiny random-init
model built from the family's config class and saved with the real Qwen2.5 tokenizer goes through a default
plan (``native`` template, LoRA with the default targets at r = 16, 2 SFT steps) by ``ftcore run``, with merged and
adapter exports, and a GGUF export wherever validate's checks (the run's pre-flight) accept one: a family they
accept must not fail at GGUF export after training, and one they refuse gets one line and exit 2, before anything
runs.

What each run must show: the printed trainable count equals the adapter file's parameter count; the merged
folder loads in plain transformers and its logits equal the base with the adapter loaded in plain peft; on
MoE families the routed experts' tensors moved. Packing where it runs on this CPU: each sample's loss in a
packed batch equals its loss alone (within 1e-5); where it does not, ``validate`` refuses ``packing = true``
in one line."""

from __future__ import annotations

import json
import re

import pytest

from conftest import SHARED, chat_rows, one_line_refusal, run_cli, write_jsonl

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             intermediate_size=64, max_position_embeddings=256)
MOE = dict(num_experts_per_tok=2)
LINEAR_ATTENTION = dict(head_dim=16, layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
                        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)
# model_type: its config fields beyond SIZES (None: SIZES do not apply, the fields are the family's own).
DENSE = {
    "llama": {}, "mistral": {}, "qwen2": {}, "qwen3": {}, "phi3": {}, "olmo2": {},
    # Queries scaled by 1/sqrt(head_dim), as in Gemma 2 and 3 up to 12B (llama.cpp assumes it there).
    "gemma2": dict(query_pre_attn_scalar=8), "gemma3_text": dict(query_pre_attn_scalar=8),
    "granite": {}, "smollm3": {}, "glm4": {}, "gpt2": {}, "gptj": dict(rotary_dim=4), "gpt_neox": {},
    "falcon": dict(head_dim=None),  # Falcon's head_dim is derived, not set
}
MOE_FAMILIES = {
    "mixtral": dict(MOE, num_local_experts=4),
    "qwen2_moe": dict(MOE, num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=32),
    # As Qwen3's MoE checkpoints are (Qwen3-30B-A3B, Qwen3-235B-A22B): llama.cpp always normalises the top k.
    "qwen3_moe": dict(MOE, num_experts=4, moe_intermediate_size=16, norm_topk_prob=True),
    "phimoe": dict(MOE, num_local_experts=4),
    "gpt_oss": dict(MOE, num_local_experts=4, layer_types=["sliding_attention", "full_attention"],
                    max_position_embeddings=131072),  # its YaRN context, as gpt-oss's checkpoints
    "olmoe": dict(MOE, num_experts=4, num_key_value_heads=4),  # no grouped queries, as OLMoE's checkpoints
    "granitemoe": dict(MOE, num_local_experts=4),
    # Layer 0 a dense MLP, layer 1 routed and shared experts; multi-head latent attention.
    "deepseek_v3": dict(MOE, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=16,
                        first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=16, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
    "glm4_moe": dict(MOE, n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=16, first_k_dense_replace=1,
                     n_group=1, topk_group=1),
    "ernie4_5_moe": dict(MOE, moe_num_experts=4, moe_intermediate_size=16, moe_k=2),
}
HYBRID = {
    "qwen3_next": dict(MOE, **LINEAR_ATTENTION, num_experts=4, moe_intermediate_size=16,
                       shared_expert_intermediate_size=16),
    # Qwen3.5's language model (its checkpoints add a vision tower); heads of 32 at least, as llama.cpp's rope
    # sections need (Qwen3.5's are 256)
    "qwen3_5_text": dict(LINEAR_ATTENTION, head_dim=32),
    "nemotron_h": dict(head_dim=16, layers_block_type=["mamba", "attention"], mamba_num_heads=4, mamba_head_dim=16,
                       n_groups=1, ssm_state_size=16, chunk_size=16),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"], num_local_experts=4, num_experts_per_tok=2,
                             shared_intermediate_size=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16,
                             mamba_chunk_size=16),
    "falcon_h1": dict(head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16,
                      mamba_chunk_size=16),
    "lfm2": dict(layer_types=["conv", "full_attention"]),
}
ENCODER_DECODER = {
    "t5": dict(d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8),
    "bart": dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                 encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=256),
}
FAMILIES = {**DENSE, **MOE_FAMILIES, **HYBRID, **ENCODER_DECODER}

PLAN = """
[run]
name = "{name}"
seed = 7

[model]
use = "hf"
path = "base"

[template]
use = "native"

[data.chat]
use = "jsonl"
path = "chat.jsonl"

[[stage]]
name = "sft"
trainer = "sft"
adapter = {{ use = "lora", r = 16 }}
data = "chat"
max_steps = 2
batch_size = 4
max_length = 64
learning_rate = 1e-3
logging_steps = 1
[[export]]
use = "merged"

[[export]]
use = "adapter"
{exports}"""
GGUF = '\n[[export]]\nuse = "gguf"\ntypes = ["f16"]\n'


def tokenizer():
    folder = SHARED / "tokenizers" / "qwen25"
    if not folder.exists():
        pytest.skip("../shared/fixtures/tokenizers/qwen25 not present")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def build(model_type: str, folder, tok):
    """The tiny random-init model of ``model_type``, saved with the tokenizer in ``folder``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type} model")
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    # The embedding rows of Qwen2.5's checkpoints: more than the tokenizer's tokens, as most models have; as
    # many as the tokenizer's for Gemma, as its checkpoints have (llama.cpp's Gemma converter keeps that many).
    tokens = dict(vocab_size=len(tok) if model_type.startswith("gemma") else 151936, pad_token_id=tok.pad_token_id, eos_token_id=eos, bos_token_id=None)
    if model_type in ENCODER_DECODER:
        config = AutoConfig.for_model(model_type, **ENCODER_DECODER[model_type], **tokens,
                                      decoder_start_token_id=tok.pad_token_id)
        auto = AutoModelForSeq2SeqLM
    else:
        fields = {k: v for k, v in {**SIZES, **FAMILIES[model_type]}.items() if v is not None}
        config = AutoConfig.for_model(model_type, **fields, **tokens)
        auto = AutoModelForCausalLM
    torch.manual_seed(0)
    model = auto.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return model.eval(), auto



def adapter_parameters(folder) -> int:
    from safetensors.torch import load_file

    return sum(t.numel() for t in load_file(folder / "adapter_model.safetensors").values())


def packed_loss_equals_alone(model) -> None:
    """Samples packed into best-fit bins on the path a packed stage takes on this CPU: each sample's next-token
    loss equals its loss in a forward pass of its own (and the same bins read as whole rows do not)."""
    import random

    import datasets
    from trl.data_utils import pack_dataset

    from ftcore_plugins.trainers._packing import BinnedBatches, attention_for, choose_path

    rng = random.Random(0)
    samples = [[rng.randrange(3, 1000) for _ in range(n)] for n in (5, 9, 14, 22, 7, 30, 3, 12)]
    bins = list(pack_dataset(datasets.Dataset.from_list([{"input_ids": s} for s in samples]), 44, strategy="bfd"))
    batch = BinnedBatches(pad_token_id=0)(bins)

    def losses(logits_of_row) -> torch.Tensor:  # each sample's summed next-token loss, bin by bin
        out = []
        for row, b in enumerate(bins):
            logits, start = logits_of_row(row), 0
            for length in b["seq_lengths"]:
                ids = torch.tensor(b["input_ids"][start + 1:start + length])
                out.append(torch.nn.functional.cross_entropy(logits[start:start + length - 1], ids, reduction="sum"))
                start += length
        return torch.stack(out)

    with torch.no_grad():
        alone = torch.stack([torch.nn.functional.cross_entropy(model(input_ids=torch.tensor([s])).logits[0, :-1],
                                                                torch.tensor(s[1:]), reduction="sum")
                             for b in bins for s in _split(b)])
        with attention_for(model, choose_path("auto", model, "cpu")):
            packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        whole = model(input_ids=batch["input_ids"], use_cache=False).logits
    per_token = torch.tensor([len(s) - 1 for b in bins for s in _split(b)])
    assert ((losses(lambda r: packed[r]) - alone) / per_token).abs().max().item() < 1e-5
    assert ((losses(lambda r: whole[r]) - alone) / per_token).abs().max().item() > 1e-3  # the check can fail


def _split(packed_bin) -> list[list[int]]:
    ids, start, out = packed_bin["input_ids"], 0, []
    for length in packed_bin["seq_lengths"]:
        out.append(ids[start:start + length])
        start += length
    return out


@pytest.mark.slow
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_a_default_lora_plan_trains_and_exports(model_type, tmp_path):
    tok = tokenizer()
    base, auto = build(model_type, tmp_path / "base", tok)
    write_jsonl(tmp_path / "chat.jsonl", chat_rows(16))
    name = model_type.replace("_", "-")
    plan = tmp_path / "plan.toml"

    # GGUF: in the run wherever its pre-flight (validate's checks) accepts it; a refusal is one line.
    plan.write_text(PLAN.format(name=name, exports=GGUF), encoding="utf-8")
    r = run_cli("run", str(plan))
    gguf = r.returncode != 2
    if not gguf:
        assert one_line_refusal(r).startswith(f"{plan}: export[2]")  # the gguf export, before anything ran
        plan.write_text(PLAN.format(name=name, exports=""), encoding="utf-8")
        r = run_cli("run", str(plan))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    exports = tmp_path / "runs" / name / "exports"
    assert (exports / "gguf").is_dir() == gguf

    # What the stage printed is what peft trained and saved.
    adapter_config = json.loads((exports / "adapter" / "adapter_config.json").read_text())
    trainable = re.search(r"adapter lora \(r=\d+\): ([\d,]+) trainable parameters", r.stdout)
    assert int(trainable[1].replace(",", "")) == adapter_parameters(exports / "adapter")
    targets = re.search(r"adapter lora: targets (.*?) \(\d+ layers\)(?:; parameters (.*?) \(\d+ tensors)?", r.stdout)
    assert targets[1].split(", ") == adapter_config["target_modules"]
    assert (targets[2].split(", ") if targets[2] else []) == (adapter_config.get("target_parameters") or [])

    # Packing: validate refuses it in one line, or each sample's loss in a packed batch is its loss alone.
    plan.write_text(PLAN.format(name=name, exports="").replace("max_length = 64", "max_length = 64\npacking = true"),
                    encoding="utf-8")
    checked = run_cli("validate", str(plan))
    if checked.returncode:
        assert "packing" in one_line_refusal(checked)
    else:
        packed_loss_equals_alone(base)

    # The merged folder in plain transformers equals the base with the adapter in plain peft.
    from peft import PeftModel

    merged = auto.from_pretrained(exports / "merged", dtype=torch.float32).eval()
    experts = {k: v.clone() for k, v in base.state_dict().items() if ".experts." in k}  # peft adapts base in place
    with_adapter = PeftModel.from_pretrained(base, exports / "adapter").eval()
    ids = torch.tensor([tok("Which word is an animal? dark child horse")["input_ids"]])
    inputs = dict(input_ids=ids, decoder_input_ids=ids[:, :4]) if model_type in ENCODER_DECODER else dict(input_ids=ids)
    with torch.no_grad():
        assert (merged(**inputs).logits - with_adapter(**inputs).logits).abs().max().item() < 1e-5
    if model_type in MOE_FAMILIES or model_type in ("qwen3_next", "granitemoehybrid"):
        moved = [k for k, v in merged.state_dict().items() if k in experts and not torch.equal(v, experts[k])]
        assert moved, "no routed expert tensor changed"
