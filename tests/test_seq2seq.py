"""Encoder-decoder models (T5, BART): rows become the prompt as the encoder's input and the answer and EOS as
labels; sft trains them with LoRA or in full; perplexity and exact match score them; the merged and adapter
exports load in plain transformers and peft; what works on causal LMs only is refused at validation."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from conftest import ROOT, run_cli  # noqa: E402
from ftcore.testing import RecordingReporter, chat_rows, stage_context, tiny_model, write_plan  # noqa: E402

EVALUATE = """
[[evaluate]]
use = "perplexity"
data = "chat_eval"

[[evaluate]]
use = "exact_match"
data = "chat_eval"
max_new_tokens = 6
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny T5 and a tiny BART from the scratch loader (random weights, a BPE tokenizer of the tiny data),
    built once: ``tiny[arch].copy()`` for a test's own."""
    return {arch: tiny_model(tmp_path_factory.mktemp(arch), architecture=arch) for arch in ("t5", "bart")}


# -- rows into encoder inputs and labels ----------------------------------------------------------------

def test_labels_are_the_answer_tokens_and_eos_and_the_inputs_the_rendered_prompt(tiny):
    from ftcore_plugins.common.chat import prompt_text
    from ftcore_plugins.common.seq2seq import encode

    m = tiny["t5"]
    tok = m.tokenizer
    chat = chat_rows(3, seed=5)
    chat[2]["messages"] = [{"role": "system", "content": "Answer briefly."}, *chat[2]["messages"],
                           {"role": "user", "content": "And again?"}, {"role": "assistant", "content": "the same"}]
    completion = [{"prompt": "Which is an animal? red fox stone", "completion": " the fox"}]
    out, stats = encode(chat + completion, tok, m.template, max_length=None)
    assert stats.kept == 4 and stats.dropped_no_labels == 0
    for row, ids, labels in zip(chat, out["input_ids"][:3], out["labels"][:3]):
        # the last assistant turn is the answer; every turn before it is the prompt, as generation renders it
        assert labels == tok(row["messages"][-1]["content"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert ids == tok(prompt_text(row, tok, m.template))["input_ids"]
        assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    assert "And again?" in tok.decode(out["input_ids"][2]) and "the cat" not in tok.decode(out["labels"][2])
    assert out["input_ids"][3] == tok("Which is an animal? red fox stone")["input_ids"]
    assert out["labels"][3] == tok(" the fox", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

    # max_length holds each side: the answer keeps its start, the prompt its start or its end
    long = [{"prompt": "one two three four five six seven eight", "completion": "a b c d e f g h"}]
    full, _ = encode(long, tok, m.template, max_length=None)
    cut, stats = encode(long, tok, m.template, max_length=4)
    assert cut["input_ids"][0] == full["input_ids"][0][:4] and cut["labels"][0] == full["labels"][0][:4]
    assert stats.truncated == 1
    left, _ = encode(long, tok, m.template, max_length=4, truncation="truncate_prompt")
    assert left["input_ids"][0] == full["input_ids"][0][-4:]
    assert encode(long, tok, m.template, max_length=4, truncation="drop")[1].dropped_too_long == 1


def test_a_tokenizer_s_own_special_tokens_frame_both_sides_with_one_eos(tiny):
    """As a BART tokenizer makes its model's inputs and targets: <s> ... </s> (EOS is not doubled)."""
    import copy

    from tokenizers import processors

    from ftcore_plugins.common.seq2seq import encode

    m = tiny["bart"]
    tok = copy.deepcopy(m.tokenizer)
    bos = "<|im_start|>"  # a stand-in for BART's <s>
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {tok.eos_token}", special_tokens=[(bos, tok.convert_tokens_to_ids(bos)),
                                                            (tok.eos_token, tok.eos_token_id)])
    out, _ = encode([{"prompt": "Which is an animal? red fox stone", "completion": "the fox"}], tok, m.template,
                    max_length=None)
    answer = m.tokenizer("the fox", add_special_tokens=False)["input_ids"]
    assert out["labels"][0] == [tok.convert_tokens_to_ids(bos), *answer, tok.eos_token_id]
    assert out["input_ids"][0][0] == tok.convert_tokens_to_ids(bos) and out["input_ids"][0][-1] == tok.eos_token_id


def test_sft_prepares_encoder_decoder_rows_for_the_seq2seq_model_only(tiny, tmp_path, monkeypatch):
    from ftcore_plugins.trainers.sft import SFT

    monkeypatch.setenv("FTCORE_CACHE_DIR", str(tmp_path / "cache"))
    rows = chat_rows(4, seed=2)
    sft = SFT(SFT.Options(max_length=64))
    t5 = tiny["t5"]
    train, _ = sft.prepare_data(stage_context(t5.copy(), tmp_path / "t5", rows))
    answer = t5.tokenizer(rows[0]["messages"][-1]["content"], add_special_tokens=False)["input_ids"]
    assert train[0]["labels"] == answer + [t5.tokenizer.eos_token_id]
    assert -100 not in train[0]["labels"] and len(train[0]["input_ids"]) > len(train[0]["labels"])


# -- training -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch, adapter", [("t5", "lora"), ("t5", "full"), ("bart", "lora"), ("bart", "full")])
def test_sft_loss_goes_down(tiny, tmp_path, monkeypatch, arch, adapter):
    from ftcore.context import AdapterContext
    from ftcore_plugins.adapters.full import FullAdapter
    from ftcore_plugins.adapters.lora import LoraAdapter
    from ftcore_plugins.trainers.sft import SFT

    monkeypatch.setenv("FTCORE_CACHE_DIR", str(tmp_path / "cache"))
    m = tiny[arch].copy()
    component = LoraAdapter(LoraAdapter.Options()) if adapter == "lora" else FullAdapter(FullAdapter.Options())
    reporter = RecordingReporter()
    m.model = component.apply(m.model, AdapterContext(None, reporter, None))
    if adapter == "lora":  # all-linear: every projection of attention, cross-attention and the MLP
        expected = "q, k, v, o, wi, wo" if arch == "t5" else "k_proj, v_proj, q_proj, out_proj, fc1, fc2"
        assert f"targets {expected} (32 layers)" in reporter.infos[0], reporter.infos
        assert m.model.peft_config["default"].task_type == "SEQ_2_SEQ_LM"
    ctx = stage_context(m, tmp_path, chat_rows(64))
    lr = 1e-2 if arch == "bart" and adapter == "lora" else 3e-3  # BART's weights start small (std 0.02)
    metrics = SFT(SFT.Options(max_steps=10, batch_size=8, learning_rate=lr, logging_steps=1, save_steps=100,
                              max_length=64)).train(ctx)
    losses = list(ctx.reporter.losses().values())
    assert len(losses) == 10
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses
    assert metrics["train_tokens"] > 0 and ctx.model is not None


# -- evaluators, exports ----------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["t5", "bart"])
def test_perplexity_scores_the_answer_tokens_as_the_model_s_own_loss(tiny, arch):
    from ftcore_plugins.common.seq2seq import encode
    from ftcore_plugins.evaluators.perplexity import score, summarize

    m = tiny[arch]
    rows = chat_rows(6, seed=3)
    columns, _ = encode(rows, m.tokenizer, m.template, max_length=None)
    scores = score(m.model, m.tokenizer, columns, batch_size=4)  # padded batches of unequal rows
    m.model.eval()
    with torch.no_grad():
        losses = [m.model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels])).loss.item() * len(labels)
                  for ids, labels in zip(columns["input_ids"], columns["labels"])]
    assert [s.tokens for s in scores] == [len(labels) for labels in columns["labels"]]
    assert [s.nll for s in scores] == pytest.approx(losses, rel=1e-4)
    assert summarize(scores)["nll"] == pytest.approx(sum(losses) / sum(s.tokens for s in scores), rel=1e-4)


@pytest.mark.slow
def test_a_t5_lora_run_evaluates_and_its_exports_load(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    plan = write_plan(tmp_path, {"model": {"architecture": "t5"},
                                 "stage": [{"name": "sft", "trainer": "sft", "data": "chat", "adapter": "lora",
                                            "max_steps": 6, "batch_size": 8, "max_length": 64,
                                            "learning_rate": 3e-3, "logging_steps": 1, "save_steps": 100}]},
                      EVALUATE + '\n[[export]]\nuse = "merged"\n\n[[export]]\nuse = "adapter"\n')
    result = run_cli("run", str(plan))
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "runs" / "tiny"
    evals = json.loads((run / "summary.json").read_text())["evaluations"]
    rows = [json.loads(line) for line in (tmp_path / "chat_eval.jsonl").read_text().splitlines()]

    merged = AutoModelForSeq2SeqLM.from_pretrained(run / "exports" / "merged")
    tok = AutoTokenizer.from_pretrained(run / "exports" / "merged")
    assert type(merged).__name__ == "T5ForConditionalGeneration"
    # perplexity scores the answers' tokens and EOS only
    answers = sum(len(tok(r["messages"][-1]["content"], add_special_tokens=False)["input_ids"]) + 1 for r in rows)
    assert evals["after"]["perplexity"]["tokens"] == answers
    assert evals["after"]["perplexity"]["perplexity"] < evals["before"]["perplexity"]["perplexity"]

    adapter_config = json.loads((run / "exports" / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["task_type"] == "SEQ_2_SEQ_LM"
    base = AutoModelForSeq2SeqLM.from_pretrained(adapter_config["base_model_name_or_path"]).eval()
    merged.eval()
    batch = tok(["<|im_start|>user\nWhich is an animal? red cat tree<|im_end|>\n", "the blue fox sees"],
                return_tensors="pt", padding=True)
    batch["decoder_input_ids"] = torch.tensor([[merged.config.decoder_start_token_id, 5, 9, 12]] * 2)
    with torch.no_grad():
        expected = merged(**batch).logits
        plain = (base(**batch).logits - expected).abs().max().item()
        adapted = PeftModel.from_pretrained(base, run / "exports" / "adapter").eval()  # wraps base in place
        diff = (adapted(**batch).logits - expected).abs().max().item()
    assert type(adapted).__name__ == "PeftModelForSeq2SeqLM"
    assert diff < 1e-5 and plain > 1e-3, (diff, plain)  # the adapter is in the merged weights, and it did something

    # exact match generated from each prompt as the encoder's input: what plain transformers generates
    predictions = [json.loads(line) for line in
                   (run / "evaluations" / "after" / "exact_match" / "predictions.jsonl").read_text().splitlines()]
    assert [p["reference"] for p in predictions] == [r["messages"][-1]["content"] for r in rows]
    for p in predictions[:4]:
        ids = tok(p["prompt"], return_tensors="pt")
        out = merged.generate(**ids, max_new_tokens=6, do_sample=False)
        assert tok.decode(out[0], skip_special_tokens=True).strip() == p["prediction"]


@pytest.mark.slow
def test_check_shows_prompt_and_answer_and_overfits_a_bart_batch(tmp_path):
    plan = write_plan(tmp_path, {"model": {"architecture": "bart"}})
    result = run_cli("check", str(plan))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "prompt (encoder) -> answer (decoder, trained)" in result.stdout
    assert "assistant\n -> the " in result.stdout and "overfit one batch" in result.stdout, result.stdout[-3000:]


def test_the_hf_loader_loads_a_t5_folder_as_a_seq2seq_model(tiny, tmp_path):
    from transformers import T5Config, T5ForConditionalGeneration

    from ftcore.context import LoadContext, RunInfo
    from ftcore_plugins.models._checks import model_type_problem
    from ftcore_plugins.models.hf import HFModelLoader
    from ftcore_plugins.quantizers.none import NoQuantizer

    tok = tiny["t5"].tokenizer
    # Flan-T5's shape: heads of d_kv, which need not divide d_model (flan-t5-small: 512 wide, 6 heads of 64)
    config = T5Config(vocab_size=len(tok), d_model=64, num_heads=6, d_kv=16, d_ff=96, num_layers=1,
                      feed_forward_proj="gated-gelu", pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                      decoder_start_token_id=tok.pad_token_id)
    saved = T5ForConditionalGeneration(config)
    saved.save_pretrained(tmp_path / "t5")
    tok.save_pretrained(tmp_path / "t5")
    loader = HFModelLoader(HFModelLoader.Options.model_validate({"path": str(tmp_path / "t5")}))
    assert loader.check(None) == [] and loader.preflight(None) == []
    model, _ = loader.load(LoadContext(RunInfo(None, tmp_path), RecordingReporter(), NoQuantizer(), seed=0,
                                       work_dir=tmp_path / "work", data=None))
    assert type(model).__name__ == "T5ForConditionalGeneration"
    assert torch.equal(model.lm_head.weight, saved.lm_head.weight)
    assert model_type_problem("bart", False, False) is None and model_type_problem("mt5", False, False) is None
    # other non-causal types keep their one line
    assert "has no causal language model" in model_type_problem("vit", False, False)
    raw = json.loads((tmp_path / "t5" / "config.json").read_text())
    (tmp_path / "t5" / "config.json").write_text(json.dumps({**raw, "model_type": "pegasus"}))
    problems = loader.preflight(None)
    assert len(problems) == 1 and "model type 'pegasus' is an encoder-decoder" in problems[0], problems


# -- what validate refuses, in one line, without torch ------------------------------------------------

IMPORTS = """
import json, sys
from ftcore.cli import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "heavy": sorted(m for m in ("torch", "transformers") if m in sys.modules)}))
"""


def _validate(plan):
    result = subprocess.run([sys.executable, "-c", IMPORTS, "validate", str(plan)], capture_output=True, text=True,
                            timeout=3600)  # only catches a hang
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr.strip().splitlines()


@pytest.mark.parametrize("stage, extra, key, said", [
    ({"trainer": "dpo", "data": "pairs"}, "", "stage[0]:", "trainer 'dpo' does not work on an encoder-decoder model "
                                                          "(t5): it trains causal language models"),
    ({"trainer": "pretrain", "data": "text"}, "", "stage[0]:", "trainer 'pretrain' does not work on an "
                                                               "encoder-decoder model (t5)"),
    ({"packing": True}, "", "stage[0].packing:", "packing does not work on an encoder-decoder model (t5)"),
    ({}, '[[export]]\nuse = "gguf"\n', "export[0].use:", "exporter 'gguf' does not work on an encoder-decoder "
                                                         "model (t5)"),
    ({"adapter": "prompt_tuning"}, "", "stage[0].adapter:", "adapter 'prompt_tuning' does not work on an "
                                                             "encoder-decoder model (t5)"),
], ids=["dpo", "pretrain", "packing", "gguf", "prompt_tuning"])
def test_validate_refuses_what_trains_or_exports_causal_lms_only(tmp_path, stage, extra, key, said):
    (tmp_path / "pairs.jsonl").write_text(json.dumps({"prompt": "Which?", "chosen": "the cat", "rejected": "red"}))
    sft = {"name": "s", "trainer": "sft", "data": "chat", "adapter": "lora", "max_steps": 2}
    pairs = {"pairs": {"use": "jsonl", "path": "pairs.jsonl"}}
    plan = write_plan(tmp_path, {"model": {"architecture": "t5"}, "data": pairs, "stage": [{**sft, **stage}]}, extra)
    report, lines = _validate(plan)
    assert report == {"code": 2, "heavy": []}, lines
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"{plan}: {key} {said}") and "Encoder-decoder models" in lines[0], lines


def test_validate_accepts_t5_and_bart_sft(tmp_path):
    for arch in ("t5", "bart"):
        merged = '\n[[export]]\nuse = "merged"\n'
        plan = write_plan(tmp_path / arch, {"model": {"architecture": arch}}, EVALUATE + merged)
        report, lines = _validate(plan)
        assert report == {"code": 0, "heavy": []}, lines


# -- the example ---------------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_seq2seq_example_learns_the_quickstart_task(tmp_path):
    """examples/seq2seq: a T5 from random weights, full fine-tuning then LoRA, from exact match 0 to >= 0.9
    (1.00 over seeds 1, 2 and 42 when it was written)."""
    from transformers import AutoModelForSeq2SeqLM

    shutil.copytree(ROOT / "examples" / "quickstart" / "data", tmp_path / "quickstart" / "data")
    shutil.copytree(ROOT / "examples" / "seq2seq", tmp_path / "seq2seq", ignore=shutil.ignore_patterns("runs"))
    result = run_cli("run", str(tmp_path / "seq2seq" / "plan.toml"))
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "seq2seq" / "runs" / "seq2seq"
    evals = json.loads((run / "summary.json").read_text())["evaluations"]
    assert evals["before"]["exact_match"]["exact_match"] <= 0.05
    assert evals["after"]["exact_match"]["exact_match"] >= 0.9, evals
    assert type(AutoModelForSeq2SeqLM.from_pretrained(run / "exports" / "merged")).__name__ == \
        "T5ForConditionalGeneration"
