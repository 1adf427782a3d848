"""Every decoder family llama.cpp's converter might write: what ``ftcore validate`` says of it, and whether
that holds after training.

For each family this transformers has, a tiny random model is saved with a real tokenizer (../shared
fixtures). The exporter's validate-time check (``gguf.converter_job`` then ``llama_cpp_converter.check``:
the converter's own code on the config and tokenizer files alone, no weights, its tensors' shapes from the
model transformers builds on the meta device, and llama.cpp loading the file without its data) either refuses
it, in one line naming the family and why, or accepts it; then every accepted family is really converted,
from its weights, and llama.cpp loads the file and evaluates a prompt with it. An accepted family that fails
there is what the check missed. All the checks run in one converter process per half of the families, and so do the
conversions (each process imports torch and the converter once), the halves side by side; under
pytest-xdist the first worker to ask computes them and the other reads them (``computed_once``).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import SHARED, computed_once, run_cli

from ftcore_plugins.exporters import llama_cpp_converter

pytest.importorskip("gguf")

TREE = llama_cpp_converter.find_converter()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    TREE is None or importlib.util.find_spec("sentencepiece") is None or importlib.util.find_spec("llama_cpp") is None,
    reason=f"llama.cpp's converter, sentencepiece or llama-cpp-python missing: {llama_cpp_converter.FETCH}; "
           "pip install sentencepiece llama-cpp-python")]

SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=128, max_position_embeddings=256, tie_word_embeddings=True)
MOE = dict(num_experts_per_tok=2)
LINEAR = dict(layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4, linear_num_key_heads=2,
              linear_key_head_dim=16, linear_value_head_dim=16)
GPT = dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, tie_word_embeddings=True)  # GPT-2's own names
# case: (model_type, tokenizer fixture, config fields): each family with the tokenizer of its kind that the
# fixtures have (Qwen's for Qwen, Llama 3's for the rest); a few cases more, each a shape llama.cpp refuses.
CASES = {
    "llama": ("llama", "llama3", SIZES),
    "mistral": ("mistral", "llama3", SIZES),
    "mixtral": ("mixtral", "llama3", dict(SIZES, **MOE, num_local_experts=4)),
    "qwen2": ("qwen2", "qwen25", SIZES),
    "qwen2_moe": ("qwen2_moe", "qwen25", dict(SIZES, **MOE, num_experts=4, moe_intermediate_size=32,
                                                 shared_expert_intermediate_size=32)),
    "qwen3": ("qwen3", "qwen3", SIZES),
    "qwen3_moe": ("qwen3_moe", "qwen3", dict(SIZES, **MOE, num_experts=4, moe_intermediate_size=32)),
    "qwen3_next": ("qwen3_next", "qwen3", dict(SIZES, **MOE, **LINEAR, num_experts=4, moe_intermediate_size=32,
                                                shared_expert_intermediate_size=32)),
    # Heads of 64, a quarter rotated, as Qwen3.5's 256: its default rope sections fit (the case below, not).
    "qwen3_5_text": ("qwen3_5_text", "qwen3", dict(SIZES, **LINEAR, head_dim=64)),
    "qwen3_5_text-narrow-heads": ("qwen3_5_text", "qwen3", dict(SIZES, **LINEAR)),
    "gemma2": ("gemma2", "llama3", dict(SIZES, query_pre_attn_scalar=16, sliding_window=16)),
    "gemma3_text": ("gemma3_text", "llama3", dict(SIZES, query_pre_attn_scalar=16, sliding_window=16)),
    # An embedding of Qwen2.5's 151,936 rows, more than its tokenizer's 151,665 tokens (as Qwen2.5's checkpoints):
    # Gemma 3's converter keeps only the tokenizer's rows of it, and writes a vocabulary of the embedding's size
    # (llama.cpp: token_embd has the wrong shape); Gemma 2's reads a tokenizer.model, which Qwen's has not.
    "gemma3_text-padded-embedding": ("gemma3_text", "qwen25", dict(SIZES, query_pre_attn_scalar=16, sliding_window=16,
                                                                   vocab_size=151936)),
    "gemma2-padded-embedding": ("gemma2", "qwen25", dict(SIZES, query_pre_attn_scalar=16, sliding_window=16,
                                                         vocab_size=151936)),
    "phi3": ("phi3", "llama3", SIZES),
    "phimoe": ("phimoe", "llama3", dict(SIZES, **MOE, num_local_experts=4)),
    "gpt_oss": ("gpt_oss", "llama3", dict(SIZES, **MOE, num_local_experts=4,
                                          layer_types=["sliding_attention", "full_attention"])),
    "deepseek_v3": ("deepseek_v3", "llama3", dict(SIZES, **MOE, num_key_value_heads=4, n_routed_experts=4,
                                                  n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1,
                                                  n_group=1, topk_group=1, q_lora_rank=16, kv_lora_rank=16,
                                                  qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)),
    "olmo2": ("olmo2", "llama3", SIZES),
    # OLMoE's attention as the published model's, without grouped key/value heads (see the report).
    "olmoe": ("olmoe", "llama3", dict(SIZES, **MOE, num_experts=4, num_key_value_heads=4)),
    # With grouped key/value heads: llama.cpp's OLMoE has none (its k_norm is hidden_size wide).
    "olmoe-grouped-kv": ("olmoe", "llama3", dict(SIZES, **MOE, num_experts=4)),
    "granite": ("granite", "llama3", SIZES),
    "granitemoe": ("granitemoe", "llama3", dict(SIZES, **MOE, num_local_experts=4)),
    "granitemoehybrid": ("granitemoehybrid", "llama3", dict(
        SIZES, layer_types=["mamba", "attention"], num_local_experts=4, num_experts_per_tok=2,
        shared_intermediate_size=64, mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_chunk_size=16)),
    # Qwen3's 151,669 tokens: the converter pads a Mamba model's vocabulary to a multiple of 8, not its embedding.
    "granitemoehybrid-qwen3-vocab": ("granitemoehybrid", "qwen3", dict(
        SIZES, layer_types=["mamba", "attention"], num_local_experts=4, num_experts_per_tok=2,
        shared_intermediate_size=64, mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_chunk_size=16)),
    "nemotron_h": ("nemotron_h", "llama3", dict(SIZES, layers_block_type=["mamba", "attention"], mamba_num_heads=4,
                                                mamba_head_dim=16, n_groups=1, ssm_state_size=16, chunk_size=16)),
    "falcon_h1": ("falcon_h1", "llama3", dict(SIZES, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
                                              mamba_d_state=16, mamba_chunk_size=16)),
    "lfm2": ("lfm2", "llama3", dict(SIZES, layer_types=["conv", "full_attention"])),
    # Its converter compares the output layer with the embedding, values not shapes (torch.equal): the check
    # runs without the tensors there, as the converter's --vocab-only, and must not refuse it.
    "mamba-untied": ("mamba", "llama3", dict(hidden_size=64, num_hidden_layers=2, state_size=8,
                                             tie_word_embeddings=False)),
    "smollm3": ("smollm3", "llama3", SIZES),
    "glm4": ("glm4", "llama3", SIZES),
    "glm4_moe": ("glm4_moe", "llama3", dict(SIZES, **MOE, n_routed_experts=4, n_shared_experts=1,
                                            moe_intermediate_size=32, first_k_dense_replace=1)),
    "ernie4_5_moe": ("ernie4_5_moe", "llama3", dict(SIZES, **MOE, moe_num_experts=4, moe_intermediate_size=32)),
    "gpt2": ("gpt2", "llama3", GPT),
    "gptj": ("gptj", "llama3", dict(GPT, rotary_dim=8)),
    "gpt_neox": ("gpt_neox", "llama3", SIZES),
    "falcon": ("falcon", "llama3", {k: v for k, v in SIZES.items() if k not in ("head_dim", "num_key_value_heads")}),
}


def available(model_type: str) -> bool:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return model_type in CONFIG_MAPPING_NAMES


def tiny_model(folder: Path, model_type: str, tokenizer, name: str, fields: dict) -> None:
    """A tiny random ``model_type`` saved as transformers saves a fine-tuned model, with the tokenizer's files
    as the hub has them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    fields = {"vocab_size": len(tokenizer), **fields}  # the tokenizer's, unless the case says
    config = AutoConfig.for_model(model_type, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=pad, **fields)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for file in (SHARED / "tokenizers" / name).iterdir():
        shutil.copyfile(file, folder / file.name)


def halves(items: list) -> list[list]:
    return [items[0::2], items[1::2]]


def compute(root: Path) -> dict:
    """Each case: refused (the check's line), or accepted and then converted (the file) or not (why)."""
    from transformers import AutoTokenizer

    from ftcore_plugins.exporters.gguf import convert_models, converter_job, unsupported_architecture

    if not (SHARED / "tokenizers").exists():
        return {"skip": "../shared fixtures absent"}
    tokenizers = {name: AutoTokenizer.from_pretrained(SHARED / "tokenizers" / name)
                  for name in sorted({t for _, t, _ in CASES.values()})}
    outcome: dict[str, dict] = {}
    jobs = []
    started = time.perf_counter()
    for case, (model_type, tokenizer, fields) in CASES.items():
        if not available(model_type):
            outcome[case] = {"absent": True}
            continue
        model = root / case / "model"
        tiny_model(model, model_type, tokenizers[tokenizer], tokenizer, fields)
        # As validate sees the plan: an hf model folder (converter_job copies its config and tokenizer files).
        plan = SimpleNamespace(model=SimpleNamespace(name="hf", options=SimpleNamespace(path=str(model))))
        (root / case / "check").mkdir()
        job = converter_job(plan, root / case / "check")
        classes = job["architectures"]
        outcome[case] = {"model": str(model), "class": classes[0]}
        # What check(plan) says first: an architecture the converter does not list (read from its source).
        why = unsupported_architecture(model_type, classes, "llama.cpp", str(TREE))
        if why is not None:
            outcome[case]["refused"] = why
        else:
            jobs.append((case, job))
    built = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        parts = halves(jobs)
        for part, answers in zip(parts, pool.map(lambda p: llama_cpp_converter.check(TREE, [j for _, j in p]), parts)):
            for (case, _), why in zip(part, answers):
                outcome[case]["refused"] = why
        checked = time.perf_counter()
        accepted = [(case, Path(outcome[case]["model"])) for case, _ in jobs if outcome[case]["refused"] is None]
        parts = halves(accepted)
        converted = pool.map(lambda p: convert_models(TREE, [(m, {"f16": m / "f16.gguf"}) for _, m in p]), parts)
        for part, reasons in zip(parts, converted):
            for (case, model), why in zip(part, reasons):
                outcome[case]["converted"] = why is None
                outcome[case]["convert_error"] = why
                outcome[case]["file"] = str(model / "f16.gguf")
    outcome["seconds"] = {"build": built - started, "check": checked - built, "convert": time.perf_counter() - checked}
    return outcome


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    def run():
        root = tmp_path_factory.mktemp("gguf-converter-families")
        return compute(root)

    found = computed_once(tmp_path_factory, "gguf-converter-families", run)
    if "skip" in found:
        pytest.skip(found["skip"])
    print(f"\nbuild {found['seconds']['build']:.0f} s, check {found['seconds']['check']:.0f} s, convert "
          f"{found['seconds']['convert']:.0f} s")
    return found


# What the check says of the cases llama.cpp cannot take: the start of its reason.
REFUSED = {
    "qwen3_5_text-narrow-heads": "it writes rope sections [11, 11, 10, 0] (32 dimensions) for heads of 16",
    "phimoe": "llama.cpp's converter in",
    "gptj": "llama.cpp's converter in",
    "granitemoehybrid-qwen3-vocab": "it writes a vocabulary of 151672 tokens for an embedding of 151669 rows",
    # Shapes llama.cpp refuses, found by loading the file the converter writes from the tensors' shapes alone.
    "gemma3_text-padded-embedding": "llama.cpp cannot load the file it writes: check_tensor_dims: tensor "
                                    "'token_embd.weight' has wrong shape; expected 64, 151936, got 64, 151665",
    "olmoe-grouped-kv": "llama.cpp cannot load the file it writes: check_tensor_dims: tensor "
                        "'blk.0.attn_k_norm.weight' has wrong shape; expected 64, got 32",
    # Llama 3's tokenizer.json, where these read a SentencePiece tokenizer.model or GLM's own special tokens.
    "gemma2": "its tokenizer: FileNotFoundError: File not found: tokenizer.model",
    "gemma2-padded-embedding": "its tokenizer: FileNotFoundError: File not found: tokenizer.model",
    "phi3": "its tokenizer: ValueError: Error: Missing tokenizer.model",
    "ernie4_5_moe": "its tokenizer: FileNotFoundError: File not found: tokenizer.model",
    "glm4": "its tokenizer: KeyError:",
    "glm4_moe": "its tokenizer: KeyError:",
}


@pytest.mark.parametrize("case", list(CASES))
def test_validate_refuses_in_one_line_or_the_family_converts_and_loads(families, case):
    outcome = families[case]
    if outcome.get("absent"):
        pytest.skip(f"this transformers has no {CASES[case][0]}")
    refused = outcome["refused"]
    print(f"\n{case}: " + (f"refused: {refused}" if refused else "accepted: converted and loaded"), end="")
    if case in REFUSED:
        assert refused is not None and refused.startswith(REFUSED[case]) and "\n" not in refused, refused
        return
    # Accepted: the weights convert, and llama.cpp loads the file and computes finite logits.
    assert refused is None, refused
    assert outcome["converted"], outcome["convert_error"]
    import numpy as np

    from ftcore_plugins.common.run_model import load_gguf

    config = json.loads((Path(outcome["model"]) / "config.json").read_text())
    llm = load_gguf(outcome["file"], n_ctx=64, logits_all=True, verbose=False, n_threads=1)
    try:
        assert llm.n_vocab() == config["vocab_size"]
        ids = llm.tokenize(b"Which word is an animal? red cat tree", add_bos=False)
        llm.eval(ids)
        assert np.isfinite(np.array(llm.scores[:len(ids)])).all()
    finally:
        llm.close()


# Case: the line ``ftcore validate`` prints after the plan's file and key: the family and the converter's reason.
CLI_LINES = {
    "gemma2": "llama.cpp's converter ({tree}) cannot write this 'gemma2' model (Gemma2ForCausalLM): its tokenizer: "
              "FileNotFoundError: File not found: tokenizer.model",
    "olmoe-grouped-kv": "llama.cpp's converter ({tree}) cannot write this 'olmoe' model (OlmoeForCausalLM): llama.cpp "
                        "cannot load the file it writes: check_tensor_dims: tensor 'blk.0.attn_k_norm.weight' has "
                        "wrong shape; expected 64, got 32, 1, 1, 1",
}


@pytest.mark.parametrize("case", list(CLI_LINES))
def test_validate_names_the_family_and_the_reason(families, tmp_path, case):
    """``ftcore validate`` on a plan whose model llama.cpp's converter refuses: one line on stderr, naming the
    plan's file and key, the family and the converter's reason, exit 2, before any weight is read; a tensor
    shape llama.cpp refuses as much as a tokenizer the converter cannot read."""
    model = families[case].get("model")
    if model is None:
        pytest.skip(f"this transformers has no {CASES[case][0]}")
    shutil.copytree(model, tmp_path / "base", ignore=shutil.ignore_patterns("*.gguf"))
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                                   {"role": "assistant", "content": "hello"}]}) + "\n")
    plan = tmp_path / "plan.toml"
    plan.write_text('[model]\nuse = "hf"\npath = "base"\n\n[data.chat]\nuse = "jsonl"\npath = "chat.jsonl"\n\n'
                    '[[stage]]\nname = "sft"\ntrainer = "sft"\ndata = "chat"\n\n[[export]]\nuse = "gguf"\n')
    r = run_cli("validate", str(plan), env={llama_cpp_converter.ENV: str(TREE)})
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [line for line in r.stderr.splitlines() if "export[0]" in line]
    assert len(lines) == 1, r.stderr
    assert f"{plan}: export[0].use: " + CLI_LINES[case].format(tree=TREE.name) in lines[0], lines
