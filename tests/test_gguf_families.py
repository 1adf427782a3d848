"""GGUF export beyond llama, mistral and qwen2: Qwen3 and Gemma 2/3 go through llama.cpp's own
``convert_hf_to_gguf.py`` (found where ``python -m ftcore_plugins.exporters.llama_cpp_converter`` put it).

Each tiny model is built from its config with a real tokenizer (Qwen3's from ../shared/fixtures; for
Gemma a SentencePiece model trained here with Gemma's settings and special tokens, under the real Gemma
chat template from the fixtures, whose own vocabulary is cropped and has no ``tokenizer.model``),
fine-tuned by ``ftcore run`` to answer and stop, and exported. llama.cpp then tokenizes each held-out
prompt as transformers does, produces the same greedy tokens up to and including the end-of-turn
token, and ``create_chat_completion`` returns the same answer with ``finish_reason == "stop"``. A
template whose end-of-turn token llama.cpp does not know by name (``<|turn_end|>``) checks that the
file's ``tokenizer.ggml.eot_token_id`` is what stops it, on the converter's files and on ftcore's own
writer's.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import tarfile

import pytest

from conftest import SHARED, chat_rows, run_cli, text_rows, write_jsonl

from ftcore_plugins.exporters import llama_cpp_converter

pytest.importorskip("gguf")

TREE = llama_cpp_converter.find_converter()
needs_converter = pytest.mark.skipif(
    TREE is None or importlib.util.find_spec("sentencepiece") is None,
    reason=f"llama.cpp's converter or sentencepiece missing: {llama_cpp_converter.FETCH}; pip install sentencepiece")

# A template with its own markers, which llama.cpp does not recognise as an end of turn by their text.
TURNS = """{% for m in messages %}<|turn_start|>{{ m.role }}
{{ m.content }}<|turn_end|>
{% endfor %}{% if add_generation_prompt %}<|turn_start|>assistant
{% endif %}"""
TURNS_OPTIONS = 'use = "jinja"\npath = "turns.jinja"\nstop_tokens = ["<|turn_end|>"]\nspecial_tokens = ["<|turn_start|>"]'
MAX_NEW = 16

PLAN = """
[run]
name = "{name}"
seed = 7

[model]
use = "hf"
path = "base"

[template]
{template}

[data.chat]
use = "jsonl"
path = "chat.jsonl"

[[stage]]
name = "sft"
trainer = "sft"
data = "chat"
adapter = "full"
max_steps = {steps}
batch_size = 8
max_length = 64
learning_rate = 1e-2
logging_steps = 20
save_steps = {steps}

[[export]]
use = "merged"

[[export]]
use = "gguf"
types = ["f16"]
"""


def sentencepiece_gemma(folder):
    """A Gemma-style tokenizer: SentencePiece BPE with byte fallback, no dummy prefix, digits split,
    <pad> <eos> <bos> <unk> at 0-3 and <start_of_turn> <end_of_turn> after them, and the real Gemma chat
    template (the fixture's). Loaded by transformers from tokenizer.model, as a Gemma checkpoint's is."""
    spm = pytest.importorskip("sentencepiece")
    fixture = SHARED / "tokenizers" / "gemma-cropped" / "tokenizer_config.json"
    data = SHARED / "data" / "alpaca_en_demo.json"
    if not fixture.exists() or not data.exists():
        pytest.skip("../shared fixtures absent")
    lines = [f"{r['instruction']} {r['input']} {r['output']}" for r in json.loads(data.read_text())[:300]]
    lines += [r["text"] for r in text_rows(64)] + [m["content"] for r in chat_rows(64) for m in r["messages"]]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, model_type="bpe", vocab_size=1000, pad_id=0, eos_id=1,
        bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"], byte_fallback=True, add_dummy_prefix=False,
        remove_extra_whitespaces=False, split_digits=True, normalization_rule_name="identity",
        character_coverage=1.0, minloglevel=2)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    template = json.loads(fixture.read_text())["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GemmaTokenizer", "add_bos_token": True, "add_eos_token": False, "bos_token": "<bos>",
        "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>", "chat_template": template}))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def base_model(folder, arch, tokenizer_name, **options):
    """A tiny random ``arch`` saved with its tokenizer (and, for Gemma, its tokenizer.model) in ``folder``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if tokenizer_name == "sentencepiece":
        tokenizer = sentencepiece_gemma(folder)
    else:
        if not (SHARED / "tokenizers" / tokenizer_name).exists():
            pytest.skip("../shared fixtures absent")
        tokenizer = AutoTokenizer.from_pretrained(SHARED / "tokenizers" / tokenizer_name)
    extra = {"head_dim": 16}
    if arch.startswith("gemma"):  # llama.cpp scales Gemma's queries by 1/sqrt(head_dim), as Gemma's 2B-12B are
        extra.update(query_pre_attn_scalar=16, sliding_window=16)  # prompts longer than the window: SWA checked
    config = AutoConfig.for_model(arch, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
                                  vocab_size=len(tokenizer), **{"tie_word_embeddings": True, **extra, **options})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)  # tokenizer.model stays beside it: transformers 5 saves tokenizer.json only
    return tokenizer


def greedy_transformers(model, ids, stops):
    import torch

    out = []
    with torch.no_grad():
        while len(out) < MAX_NEW:
            out.append(int(model(torch.tensor([ids + out])).logits[0, -1].argmax()))
            if out[-1] in stops:
                break
    return out


def greedy_llama_cpp(llm, ids):
    """llama.cpp's own greedy tokens, up to and including its first end-of-generation token."""
    from llama_cpp import llama_cpp

    out = []
    for token in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(token))
        if llama_cpp.llama_vocab_is_eog(llm._model.vocab, token) or len(out) == MAX_NEW:
            break
    return out


def exported(tmp_path, arch, tokenizer_name, template, steps):
    base = tmp_path / "base"
    base_model(base, arch, tokenizer_name)
    write_jsonl(tmp_path / "chat.jsonl", chat_rows(64))
    (tmp_path / "turns.jinja").write_text(TURNS, encoding="utf-8")
    name = f"tiny-{arch.replace('_', '-')}"
    (tmp_path / "plan.toml").write_text(PLAN.format(name=name, template=template, steps=steps), encoding="utf-8")
    r = run_cli("run", str(tmp_path / "plan.toml"), env={"FTCORE_LLAMA_CPP": str(TREE)} if TREE else None)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return tmp_path / "runs" / name / "exports", name


FAMILIES = [
    pytest.param("qwen3", "qwen3", 'use = "native"', "qwen3", marks=needs_converter, id="qwen3-native"),
    pytest.param("gemma2", "sentencepiece", 'use = "native"', "gemma2", marks=needs_converter, id="gemma2-native"),
    pytest.param("gemma3_text", "sentencepiece", TURNS_OPTIONS, "gemma3", marks=needs_converter,
                 id="gemma3-turn-tokens"),
    # ftcore's own writer (qwen2), with the same end-of-turn token llama.cpp does not know by name.
    pytest.param("qwen2", "qwen25", TURNS_OPTIONS, "qwen2", id="qwen2-writer-turn-tokens"),
]


@pytest.mark.slow
@pytest.mark.parametrize("arch,tokenizer_name,template,gguf_arch", FAMILIES)
def test_llama_cpp_answers_as_transformers_and_stops_at_the_end_of_turn(tmp_path, arch, tokenizer_name, template,
                                                                        gguf_arch):
    pytest.importorskip("llama_cpp")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ftcore_plugins.common.run_model import load_gguf

    exports, name = exported(tmp_path, arch, tokenizer_name, template, steps=60)
    model = AutoModelForCausalLM.from_pretrained(exports / "merged", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(exports / "merged")
    end = "<|turn_end|>" if "turn_end" in template else {"qwen3": "<|im_end|>"}.get(arch, "<end_of_turn>")
    end_id = tokenizer.convert_tokens_to_ids(end)
    path = exports / "gguf" / f"{name}-f16.gguf"

    card = (exports / "gguf" / "README.md").read_text()
    assert ("convert_hf_to_gguf.py" in card) == (gguf_arch != "qwen2")
    assert "| f16 max_abs_logit_diff |" in card
    modelfile = (exports / "gguf" / "Modelfile").read_text()
    assert modelfile.startswith(f"FROM ./{name}-f16.gguf\nTEMPLATE \"\"\"") and f'PARAMETER stop "{end}"' in modelfile

    llm = load_gguf(path, n_ctx=256, verbose=False, n_threads=2, seed=0)
    assert llm.metadata["general.architecture"] == gguf_arch
    assert llm.metadata["tokenizer.ggml.eot_token_id"] == str(end_id)
    assert llm.metadata["tokenizer.chat_template"] == tokenizer.chat_template
    stops = {end_id, tokenizer.eos_token_id}
    rows = chat_rows(12, seed=1)
    stopped = 0
    for row in rows:
        turn = row["messages"][:1]
        prompt = tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert llm.tokenize(prompt.encode(), add_bos=False, special=True) == ids, prompt
        expected = greedy_transformers(model, ids, stops)
        assert greedy_llama_cpp(llm, ids) == expected, prompt
        stopped += expected[-1] == end_id
        reply = llm.create_chat_completion(turn, temperature=0.0, top_k=1, repeat_penalty=1.0, max_tokens=MAX_NEW)
        choice = reply["choices"][0]
        answer = tokenizer.decode(expected[:-1] if expected[-1] in stops else expected, skip_special_tokens=True)
        assert choice["message"]["content"].strip() == answer.strip(), prompt
        assert choice["finish_reason"] == ("stop" if expected[-1] in stops else "length"), prompt
    # The fine-tuned model answers and ends its turn: what stops llama.cpp is the end-of-turn token.
    assert stopped == len(rows)
    llm.close()
    record = [json.loads(line) for line in (exports.parent / "metrics.jsonl").read_text().splitlines()]
    check = [r for r in record if "f16 max_abs_logit_diff" in r][-1]
    print(f"\n{arch}: f16 max abs logit diff {check['f16 max_abs_logit_diff']:.3g} (bound {check['f16 tolerance']:.3g}); "
          f"same greedy tokens and stopped at {end} on {stopped}/{len(rows)} prompts")


@needs_converter
def test_validate_names_what_the_converter_cannot_write(tiny_project, tmp_path):
    """Qwen3 from scratch passes validation where llama.cpp's converter is found; without it, or for an
    architecture it does not convert, validate says so in one line."""
    plan = tiny_project('[[export]]\nuse = "gguf"\n', name="qwen3.toml")
    plan.write_text(plan.read_text().replace('use = "scratch"', 'use = "scratch"\narchitecture = "qwen3"'))
    r = run_cli("validate", str(plan), env={"FTCORE_LLAMA_CPP": str(TREE)})
    assert r.returncode == 0, r.stdout + r.stderr
    r = run_cli("validate", str(plan), env={"FTCORE_LLAMA_CPP": str(tmp_path)})
    assert r.returncode == 2
    assert (f"export[0].use: exporter 'gguf' writes llama, mistral and qwen2 models itself and this model ('qwen3') "
            f"with llama.cpp's convert_hf_to_gguf.py, and it is not installed: {llama_cpp_converter.FETCH}") \
        in r.stdout + r.stderr, r.stdout + r.stderr
    xlm = tiny_project('[[export]]\nuse = "gguf"\n', name="xlm.toml")
    xlm.write_text(xlm.read_text().replace('use = "scratch"', 'use = "scratch"\narchitecture = "xlm"'))
    r = run_cli("validate", str(xlm), env={"FTCORE_LLAMA_CPP": str(TREE)})
    assert r.returncode == 2
    assert "does not convert XLMWithLMHeadModel (model type 'xlm')" in r.stdout + r.stderr, r.stdout + r.stderr


@needs_converter
def test_converter_is_unpacked_from_a_source_distribution(tmp_path, monkeypatch):
    """--sdist keeps only the converter's files of llama-cpp-python's source layout, where the exporter
    finds them (by $FTCORE_LLAMA_CPP or the data folder), and reads the architectures it registers."""
    sdist = tmp_path / "llama_cpp_python-9.9.9.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        # The tree's own models/ (official templates where the fetch step kept them) is replaced by the one below.
        tar.add(TREE, arcname="llama_cpp_python-9.9.9/vendor/llama.cpp",
                filter=lambda member: None if "/vendor/llama.cpp/models" in member.name else member)
        extra = tmp_path / "README.md"
        extra.write_text("not the converter")
        tar.add(extra, arcname="llama_cpp_python-9.9.9/README.md")
        tar.add(extra, arcname="llama_cpp_python-9.9.9/vendor/llama.cpp/docs/build.md")
        tar.add(extra, arcname="llama_cpp_python-9.9.9/vendor/llama.cpp/models/ggml-vocab-x.gguf")
        tar.add(extra, arcname="llama_cpp_python-9.9.9/vendor/llama.cpp/models/templates/Org-Model.jinja")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert llama_cpp_converter.main(["--sdist", str(sdist)]) == 0
    tree = tmp_path / "data" / "ftcore" / "llama.cpp" / "9.9.9"
    assert sorted(p.name for p in tree.iterdir()) == sorted(["LICENSE", "conversion", "convert_hf_to_gguf.py",
                                                             "gguf-py", "models"])
    assert [p.relative_to(tree).as_posix() for p in (tree / "models").rglob("*")] == \
        ["models/templates", "models/templates/Org-Model.jinja"]  # the official templates, no vocabularies
    assert {"Qwen3ForCausalLM", "Gemma3ForCausalLM", "Gemma2ForCausalLM", "Phi3ForCausalLM"} \
        <= llama_cpp_converter.registered(tree)
    monkeypatch.setenv(llama_cpp_converter.ENV, str(sdist))
    assert llama_cpp_converter.find_converter() == tree
    monkeypatch.setenv(llama_cpp_converter.ENV, str(tmp_path / "nowhere"))
    assert llama_cpp_converter.find_converter() is None
    assert os.environ[llama_cpp_converter.ENV]


def test_the_fetch_step_keeps_llama_cpps_chat_templates_and_a_second_run_adds_them(tmp_path, monkeypatch, capsys):
    """llama.cpp's official chat templates (models/templates/, which ftcore's tests render) are kept beside the
    converter and found by name; a converter fetched before they were kept gets them when the step runs again."""
    def sdist(name: str, files: dict[str, str]):
        path = tmp_path / name / "llama_cpp_python-9.9.8.tar.gz"
        path.parent.mkdir()
        with tarfile.open(path, "w:gz") as tar:
            for member, text in files.items():
                info = tarfile.TarInfo(f"llama_cpp_python-9.9.8/vendor/llama.cpp/{member}")
                info.size = len(text.encode())
                tar.addfile(info, io.BytesIO(text.encode()))
        return path

    converter = {"convert_hf_to_gguf.py": "# the converter\n", "LICENSE": "MIT\n"}
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    tree = tmp_path / "data" / "ftcore" / "llama.cpp" / "9.9.8"
    assert llama_cpp_converter.main(["--sdist", str(sdist("old", converter))]) == 0
    assert llama_cpp_converter.official_template("Org-Model", tree) is None  # an older fetch: no templates
    assert llama_cpp_converter.main(["--sdist", str(sdist("new", {
        **converter, "models/templates/Org-Model.jinja": "{{ messages }}", "models/templates/Org-Other.jinja": "",
        "models/templates/README.md": "MIT\n",
        "models/ggml-vocab-x.gguf": "vocabulary"}))]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == \
        f"llama.cpp's converter is in {tree} (0 architectures, 2 chat templates)"
    assert llama_cpp_converter.official_template("Org-Model", tree) == tree / "models" / "templates" / "Org-Model.jinja"
    assert (tree / "models" / "templates" / "Org-Model.jinja").read_text() == "{{ messages }}"
    assert sorted(p.name for p in (tree / "models").iterdir()) == ["templates"]
    assert llama_cpp_converter.official_template("Absent-Model", tree) is None


@needs_converter
def test_gpt_neox_converts_with_its_share_of_rotated_dimensions(tmp_path):
    """transformers 5 folds GPT-NeoX's ``rotary_pct`` into ``rope_parameters``, and llama.cpp's converter,
    reading the config through transformers, failed with a bare ``KeyError: 'rotary_pct'``. The converter's
    runner puts the old key back; llama.cpp then reads the file and gives transformers' logits. A file cut
    short is refused with llama.cpp's own reason."""
    pytest.importorskip("llama_cpp")
    import numpy as np
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from ftcore_plugins.common.run_model import load_gguf

    if not (SHARED / "tokenizers" / "qwen25").exists():
        pytest.skip("../shared fixtures absent")
    tokenizer = AutoTokenizer.from_pretrained(SHARED / "tokenizers" / "qwen25")
    config = AutoConfig.for_model("gpt_neox", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, vocab_size=len(tokenizer), max_position_embeddings=256)
    assert config.rope_parameters["partial_rotary_factor"] == 0.25 and "rotary_pct" not in config.to_dict()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    [why], result = llama_cpp_converter.convert(TREE, [(tmp_path, tmp_path / "neox.gguf", "f32")], "neox")
    assert why is None, result.stderr[-2000:]
    llm = load_gguf(tmp_path / "neox.gguf", n_ctx=64, verbose=False, logits_all=True)
    assert llm.metadata["general.architecture"] == "gptneox"
    assert llm.metadata["gptneox.rope.dimension_count"] == "4"  # a quarter of the head's 16
    ids = tokenizer("Which word is an animal? red cat tree", add_special_tokens=False)["input_ids"]
    llm.eval(ids)
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(np.array(llm.scores[:len(ids)]) - expected).max() < 1e-3
    llm.close()
    # A file llama.cpp cannot load: its own reason, from its log, not only llama-cpp-python's "Failed to load".
    data = (tmp_path / "neox.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match=r"Failed to load model from file: .*cut\.gguf: llama_model_load: error "
                                         r"loading model: tensor '[^']+' data is not within the file bounds"):
        load_gguf(tmp_path / "cut.gguf", verbose=False)
