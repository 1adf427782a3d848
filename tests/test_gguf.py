"""Exporter ``gguf``: the files read back with the gguf package, load in transformers' own GGUF
reader with the same logits, and, where llama-cpp-python is installed, llama.cpp tokenizes like the
HF tokenizer and generates the same greedy tokens as transformers."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from conftest import ROOT, SHARED, TINY_HEADER, chat_rows, run_cli, text_rows, write_jsonl

from ftcore_plugins.common.run_model import load_gguf

pytest.importorskip("gguf")

PROMPTS = ["the red cat", "Which is an animal? stone dog blue", "the tree sees the"]

TRAINED = """
[[stage]]
name = "pretrain"
trainer = "pretrain"
data = "text"
adapter = "full"
max_steps = 40
batch_size = 8
max_length = 64
learning_rate = 1e-2
logging_steps = 10
save_steps = 40

[[stage]]
name = "sft"
trainer = "sft"
data = "chat"
adapter = { use = "lora", r = 4, lora_alpha = 8 }
max_steps = 8
batch_size = 8
max_length = 64
learning_rate = 3e-3
logging_steps = 4
save_steps = 8

[[export]]
use = "merged"

[[export]]
use = "gguf"
types = ["f16", "q8_0"]
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny llama pre-trained, LoRA-tuned and exported as merged transformers folder and GGUF files."""
    folder = tmp_path_factory.mktemp("gguf-run")
    write_jsonl(folder / "text.jsonl", text_rows(64))
    write_jsonl(folder / "chat.jsonl", chat_rows(64))
    write_jsonl(folder / "chat_eval.jsonl", chat_rows(16, seed=1))
    (folder / "plan.toml").write_text(TINY_HEADER + TRAINED, encoding="utf-8")
    r = run_cli("run", str(folder / "plan.toml"))
    assert r.returncode == 0, r.stdout + r.stderr
    return folder / "runs" / "tiny" / "exports"


def reference(folder):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), \
        AutoTokenizer.from_pretrained(folder)


def unpermute(weights, n_head):
    """Undo llama.cpp's q/k row order (rows 2i, 2i+1 of each head back to i, i + d/2)."""
    d = weights.shape[0] // n_head
    return weights.reshape(n_head, d // 2, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def hf_name(gguf_name: str) -> str:
    names = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
             "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    return f"{names[parts[0]]}.{parts[1]}"


@pytest.mark.slow
def test_gguf_reads_back_with_the_weights_tokenizer_and_template(trained):
    import gguf
    from gguf.quants import dequantize

    model, tokenizer = reference(trained / "merged")
    weights = {k: v.numpy() for k, v in model.state_dict().items()}
    config = model.config
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    files = sorted(p.name for p in (trained / "gguf").iterdir())
    assert files == ["Modelfile", "README.md", "tiny-f16.gguf", "tiny-q8_0.gguf"]
    for kind, tolerance in (("f16", 1e-3), ("q8_0", 2e-2)):
        reader = gguf.GGUFReader(trained / "gguf" / f"tiny-{kind}.gguf")
        field = lambda key: reader.fields[key].contents()  # noqa: E731
        assert field("general.architecture") == "llama"
        assert field("llama.block_count") == config.num_hidden_layers
        assert field("llama.attention.head_count_kv") == config.num_key_value_heads
        # Tokens in id order, exactly the HF tokenizer's vocabulary; the chat template is the plan's.
        vocab = tokenizer.get_vocab()
        assert field("tokenizer.ggml.tokens") == sorted(vocab, key=vocab.get)
        assert field("tokenizer.ggml.pre") == "gpt-2"
        assert field("tokenizer.ggml.eos_token_id") == tokenizer.eos_token_id
        # The plan's template (chatml) ends turns with <|im_end|>, not the tokenizer's EOS: llama.cpp stops there.
        assert field("tokenizer.ggml.eot_token_id") == tokenizer.convert_tokens_to_ids("<|im_end|>") \
            != tokenizer.eos_token_id
        assert field("tokenizer.chat_template") == tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
        # Tied embeddings: no output.weight, llama.cpp reads token_embd for the output layer.
        names = [t.name for t in reader.tensors]
        assert len(names) == len(set(names)) == len(weights) - 1 and "output.weight" not in names
        for t in reader.tensors:
            expected = weights[hf_name(t.name)]
            got = dequantize(t.data, t.tensor_type).reshape(expected.shape)
            if t.name.split(".")[-2] in heads:
                got = unpermute(got, heads[t.name.split(".")[-2]])
            assert t.tensor_type.name == ("F32" if expected.ndim == 1 else kind.upper()), t.name
            scale = np.abs(expected).max()
            assert np.abs(got - expected).max() <= tolerance * scale, t.name


@pytest.mark.slow
def test_transformers_gguf_reader_gives_the_same_logits(trained):
    """transformers' own GGUF loader (it undoes llama.cpp's q/k permutation itself) rebuilds the model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = reference(trained / "merged")
    loaded = AutoModelForCausalLM.from_pretrained(trained / "gguf", gguf_file="tiny-f16.gguf", dtype=torch.float32)
    loaded_tokenizer = AutoTokenizer.from_pretrained(trained / "gguf", gguf_file="tiny-f16.gguf")
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        assert loaded_tokenizer(prompt)["input_ids"] == ids[0].tolist()
        with torch.no_grad():
            a, b = model(ids).logits, loaded(ids).logits
        assert (a - b).abs().max() < 1e-2 * a.abs().max(), prompt


def greedy_transformers(model, ids: list[int], n: int) -> list[int]:
    """Argmax tokens from transformers' logits, past any end of turn: ``generate`` with
    ``min_new_tokens`` would forbid EOS tokens and pick the runner-up instead."""
    import torch

    tokens = list(ids)
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(ids):]


def greedy_llama_cpp(llm, ids: list[int], n: int) -> list[int]:
    """Argmax tokens from llama.cpp's own logits (no sampler, no stop on end of text)."""
    import numpy as np

    llm.reset()
    out = []
    tokens = list(ids)
    for _ in range(n):
        llm.eval(tokens if not out else [out[-1]])
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        tokens = []
    return out


def llama_cpp_matches(gguf_file, model, tokenizer, prompts, n=8):
    """llama.cpp tokenizes each prompt as the HF tokenizer does and predicts the same greedy tokens."""
    pytest.importorskip("llama_cpp")

    llm = load_gguf(gguf_file, n_ctx=128, logits_all=True, verbose=False, n_threads=2, seed=0)
    for prompt in prompts:
        ids = tokenizer(prompt)["input_ids"]
        # add_bos=True adds a BOS only where the file says the tokenizer adds one (Llama-3 does).
        assert llm.tokenize(prompt.encode(), add_bos=True, special=True) == ids, prompt
        assert greedy_llama_cpp(llm, ids, n) == greedy_transformers(model, ids, n), prompt
    return llm


@pytest.mark.slow
def test_llama_cpp_generates_the_same_greedy_tokens(trained):
    model, tokenizer = reference(trained / "merged")
    chat = [{"role": "user", "content": "Which is an animal? red fox stone"}]
    prompts = [*PROMPTS, tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)]
    llm = llama_cpp_matches(trained / "gguf" / "tiny-f16.gguf", model, tokenizer, prompts)
    assert llm.metadata["tokenizer.chat_template"] == tokenizer.chat_template
    # q8_0: llama.cpp loads it and its logits stay close to the f16 file's.
    q8 = load_gguf(trained / "gguf" / "tiny-q8_0.gguf", n_ctx=128, logits_all=True, verbose=False)
    ids = tokenizer(PROMPTS[0])["input_ids"]
    for m in (llm, q8):
        m.reset()
        m.eval(ids)
    f16, q8_0 = llm.scores[len(ids) - 1], q8.scores[len(ids) - 1]
    assert np.abs(f16 - q8_0).max() < 0.05 * np.abs(f16).max()



@pytest.mark.slow
def test_quantized_file_difference_recorded_is_llama_cpps(trained):
    """The q8_0 file's logit difference in metrics.jsonl is llama.cpp's: recomputed here from the merged
    folder (its saved chat template renders the exporter's prompts) and llama.cpp's logits on the file."""
    import json

    import torch

    from ftcore_plugins.exporters.merged import PROMPTS as CHECK_PROMPTS

    pytest.importorskip("llama_cpp")
    records = [json.loads(line) for line in (trained.parent / "metrics.jsonl").read_text().splitlines()]
    recorded = [r for r in records if r["stage"] == "export:gguf" and "q8_0 max_abs_logit_diff" in r][-1]
    recorded = recorded["q8_0 max_abs_logit_diff"]
    model, tokenizer = reference(trained / "merged")
    llm = load_gguf(trained / "gguf" / "tiny-q8_0.gguf", n_ctx=128, logits_all=True, verbose=False)
    diff = 0.0
    for prompt in CHECK_PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        llm.reset()
        llm.eval(ids)
        with torch.no_grad():
            expected = model(torch.tensor([ids])).logits[0].numpy()
        diff = max(diff, float(np.abs(llm.scores[: len(ids)] - expected).max()))
    assert 0 < recorded == pytest.approx(diff, rel=1e-3)
    assert "| q8_0 read back by | llama.cpp |" in (trained / "gguf" / "README.md").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("reader", ["llama.cpp", "transformers"])
def test_a_written_file_is_checked_by_its_reader_and_removed_when_wrong(trained, tmp_path, reader):
    """The f16 file's check, by llama.cpp (where installed: what the export ran, its bound 2% of the largest
    logit) and by transformers' reader (without llama-cpp-python: 0.05 absolute): the file passes against
    the merged model's logits, and is removed, in one line, against logits it does not give."""
    import shutil

    from ftcore.errors import FtcoreError
    from ftcore_plugins.exporters.gguf import GgufExporter
    from ftcore_plugins.exporters.merged import logits

    if reader == "llama.cpp":
        pytest.importorskip("llama_cpp")
        card = (trained / "gguf" / "README.md").read_text()
        assert "| f16 read back by | llama.cpp |" in card and "| f16 tolerance |" in card
    model, tokenizer = reference(trained / "merged")
    inputs = [tokenizer(prompt, return_tensors="pt")["input_ids"] for prompt in PROMPTS]
    expected = logits(model, inputs)
    exporter = GgufExporter()
    check = exporter.verify_llama_cpp if reader == "llama.cpp" else exporter.verify
    copy = shutil.copy(trained / "gguf" / "tiny-f16.gguf", tmp_path / "tiny-f16.gguf")
    record = check(copy, "f16", inputs, expected)
    scale = max(float(e.abs().max()) for e in expected)
    bound = 0.02 * scale if reader == "llama.cpp" else 0.05
    assert record["f16 tolerance"] == pytest.approx(bound) and 0 < record["f16 max_abs_logit_diff"] < bound
    with pytest.raises(FtcoreError, match=f"tiny-f16.gguf read back by {reader} gives logits up to .* above tolerance"):
        check(copy, "f16", inputs, [e + 3 * bound for e in expected])
    assert not copy.exists()


# llama itself is the trained model above (and mistral is written in llama's layout).
ARCHITECTURES = [("mistral", "llama3", "llama-bpe"), ("qwen2", "qwen25", "qwen2")]


@pytest.mark.slow
@pytest.mark.parametrize("arch,tokenizer_name,pre", ARCHITECTURES)
def test_architectures_with_real_tokenizers(tmp_path, arch, tokenizer_name, pre):
    """A tiny random mistral (untied output) and qwen2 (q/k/v biases) with the Llama-3 and Qwen2.5
    tokenizers: exported without training, llama.cpp reads back exactly the model's parameters, tokenizes
    as the tokenizer does and computes the same logits. (transformers' GGUF loader reads these 128k- and
    151k-token vocabularies in 25 s a file; llama.cpp, the format's consumer, in under one.)"""
    if not (SHARED / "tokenizers" / tokenizer_name).exists():
        pytest.skip("../shared fixtures absent")
    llama_cpp = pytest.importorskip("llama_cpp")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SHARED / "tokenizers" / tokenizer_name)
    config = AutoConfig.for_model(arch, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
                                  vocab_size=len(tokenizer), tie_word_embeddings=arch != "mistral",
                                  initializer_range=0.2)  # logits far from flat, so greedy has no near-ties
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    if arch == "qwen2":  # random biases, so a wrong bias layout would show
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.2)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    (tmp_path / "plan.toml").write_text(
        f'[run]\nname = "tiny-{arch}"\n\n[model]\nuse = "hf"\npath = "model"\n\n[template]\nuse = "native"\n\n'
        '[[export]]\nuse = "gguf"\ntypes = ["f16"]\n', encoding="utf-8")
    r = run_cli("run", str(tmp_path / "plan.toml"))
    assert r.returncode == 0, r.stdout + r.stderr
    path = tmp_path / "runs" / f"tiny-{arch}" / "exports" / "gguf" / f"tiny-{arch}-f16.gguf"
    llm = load_gguf(path, n_ctx=128, logits_all=True, verbose=False, n_threads=1, seed=0)
    assert llm.metadata["general.architecture"] == ("qwen2" if arch == "qwen2" else "llama")
    assert llm.metadata["tokenizer.ggml.pre"] == pre
    assert llm.metadata["tokenizer.chat_template"] == tokenizer.chat_template
    # The model's parameters, each once: mistral's untied output layer is written, qwen2's tied one is not.
    assert llama_cpp.llama_model_n_params(llm.model) == sum(p.numel() for p in model.parameters())

    text = "Hello world, 12345 it's  2 spaces\n\nand ÄÖ 🦙 done."
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert llm.tokenize(text.encode(), add_bos=False, special=True) == ids
    llm.eval(ids)
    with torch.no_grad():
        a = model(torch.tensor([ids])).logits[0].numpy()
    b = llm.scores[: len(ids)]
    assert np.abs(a - b).max() < 1e-2 * np.abs(a).max()
    llm.close()

    if importlib.util.find_spec("llama_cpp") is not None:  # the llama.cpp check, where it is installed
        llama_cpp_matches(path, model, tokenizer, [text, "the quick brown fox"], n=6)


@pytest.mark.slow
def test_modelfile_spells_out_the_template_and_stop(trained):
    """The Modelfile beside the files (and in the card): FROM the last type, the plan's ChatML as Ollama's Go
    template, the end-of-turn token (then the tokenizer's EOS) as stops."""
    modelfile = (trained / "gguf" / "Modelfile").read_text()
    assert modelfile == (
        'FROM ./tiny-q8_0.gguf\n'
        'TEMPLATE """{{ range .Messages }}{{ if eq .Role "system" }}<|im_start|>system\n{{ .Content }}<|im_end|>\n'
        '{{ else if eq .Role "user" }}<|im_start|>user\n{{ .Content }}<|im_end|>\n'
        '{{ else if eq .Role "assistant" }}<|im_start|>assistant\n{{ .Content }}<|im_end|>\n'
        '{{ end }}{{ end }}<|im_start|>assistant\n"""\n'
        'PARAMETER stop "<|im_end|>"\nPARAMETER stop "<|endoftext|>"\n')
    card = (trained / "gguf" / "README.md").read_text()
    assert modelfile in card and "ollama create mymodel -f exports/gguf/Modelfile" in card


def test_validate_refuses_what_gguf_cannot_write(tiny_project):
    bad_type = tiny_project('[[export]]\nuse = "gguf"\ntypes = ["f16", "q9_9"]\n', name="type.toml")
    r = run_cli("validate", str(bad_type))
    assert r.returncode == 2 and "export[0].types[1]: input should be 'f32'" in r.stdout + r.stderr, r.stdout + r.stderr
    # check(plan) runs once the options are valid: the architecture is known from the scratch loader.
    gpt2 = tiny_project('[[export]]\nuse = "gguf"\nconverter = "ftcore"\n', name="arch.toml")
    gpt2.write_text(gpt2.read_text().replace('use = "scratch"', 'use = "scratch"\narchitecture = "gpt2"'))
    r = run_cli("validate", str(gpt2))
    assert r.returncode == 2
    assert "export[0].converter: converter = \"ftcore\" writes llama, mistral and qwen2 models; this model is 'gpt2'" \
        in r.stdout + r.stderr, r.stdout + r.stderr


@pytest.mark.slow
def test_llama_cpp_answers_the_quickstart_prompts_as_transformers_does(quickstart_run, tmp_path):
    """benchmarks/llama_cpp_parity.py on the session's quickstart run, its merged model exported as f16 and
    q8_0 by a run with no stages: every one of the 100 held-out prompts tokenizes the same in llama.cpp and
    gets the same greedy answer."""
    pytest.importorskip("llama_cpp")
    spec = importlib.util.spec_from_file_location("llama_cpp_parity", ROOT / "benchmarks" / "llama_cpp_parity.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    plan = bench.gguf_plan(quickstart_run, tmp_path)
    done = run_cli("run", str(plan))
    assert done.returncode == 0, done.stderr[-3000:]
    results = {r["file"]: r for r in bench.parity(plan.parent / "runs" / "quickstart")}
    print("\n" + "\n".join(f"{name}: tokenization {r['same_tokenization']}/{r['prompts']}, greedy answer "
                                f"{r['same_greedy_answer']}/{r['prompts']}" for name, r in results.items()))
    assert sorted(results) == ["quickstart-f16.gguf", "quickstart-q8_0.gguf"]
    for r in results.values():
        assert r["prompts"] == 100 and r["same_tokenization"] == 100
    assert results["quickstart-f16.gguf"]["same_greedy_answer"] == 100
    assert results["quickstart-q8_0.gguf"]["same_greedy_answer"] >= 95  # 8-bit weights may flip a near tie
