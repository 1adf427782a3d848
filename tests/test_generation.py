"""The `generation` evaluator: metrics equal what rouge-score and sacrebleu compute themselves,
the SQuAD normalisation, format compliance, bootstrap intervals, sampling options, and a real run
whose predictions equal a greedy `generate` of the same model; `exact_match` shares its loop."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
rouge_scorer = pytest.importorskip("rouge_score.rouge_scorer")
sacrebleu = pytest.importorskip("sacrebleu")

from conftest import chat_rows, run_cli, write_jsonl  # noqa: E402
from test_evaluators import quiet_reporter, tiny_model  # noqa: E402, F401  (the shared tiny scratch model)

from ftcore_plugins.evaluators.generation import (  # noqa: E402
    Generation,
    corpus_bleu,
    resample,
    row_metrics,
    squad_normalize,
    summarize,
)

PREDICTIONS = ["The cat sat on the mat.", "a dog", "Paris", "blue whale swims", "42 apples", ""]
REFERENCES = ["the cat sat on a mat", "The dog!", "Paris", "the blue whale swims fast", "42", "nothing"]
ALL = ["exact_match", "exact_match_normalized", "rouge_l", "bleu", "format"]


def test_metrics_equal_the_libraries_own_values():
    per_row = row_metrics(PREDICTIONS, REFERENCES, ALL, pattern=r"\d+ \w+")
    scorer = rouge_scorer.RougeScorer(["rougeL"])
    expected_rouge = [scorer.score(r, p)["rougeL"].fmeasure for p, r in zip(PREDICTIONS, REFERENCES)]
    assert per_row["rouge_l"] == pytest.approx(expected_rouge)
    assert 0 < sum(expected_rouge) / 6 < 1
    assert per_row["exact_match"] == [0, 0, 1, 0, 0, 0]
    assert per_row["exact_match_normalized"] == [1, 1, 1, 0, 0, 0]
    assert per_row["format"] == [0, 0, 0, 0, 1, 0]
    assert "bleu" not in per_row  # corpus BLEU is not a mean over rows

    report = summarize(per_row, (PREDICTIONS, REFERENCES), resamples=0, confidence=0.95, seed=0)
    assert report["bleu"] == pytest.approx(sacrebleu.corpus_bleu(PREDICTIONS, [REFERENCES]).score)
    mean_sentence_bleu = sum(sacrebleu.sentence_bleu(p, [r]).score for p, r in zip(PREDICTIONS, REFERENCES)) / 6
    assert abs(report["bleu"] - mean_sentence_bleu) > 1  # corpus BLEU, not a mean of sentence scores
    assert report["rouge_l"] == pytest.approx(sum(expected_rouge) / 6)
    assert report["exact_match_normalized"] == pytest.approx(0.5)
    assert not any(k.endswith("ci_low") for k in report)


@pytest.mark.parametrize(("prediction", "reference", "equal"), [
    ("The Cat!", "cat", True),
    ("  an   apple. ", "Apple", True),
    ("the end", "theend", False),  # articles go only as whole words
    ("there", "re", False),
    ("U.S.A.", "usa", True),
    ("Cat", "Dog", False),
    ("café", "CAFÉ", True),
])
def test_squad_normalisation(prediction, reference, equal):
    assert (squad_normalize(prediction) == squad_normalize(reference)) is equal


def test_format_is_a_full_match_of_the_stripped_answer():
    answers = ["42", "x42", " 7 \n", "", "12 34"]
    assert row_metrics(answers, answers, ["format"], pattern=r"\d+")["format"] == [1, 0, 1, 0, 0]


def test_bootstrap_interval_brackets_the_estimate_and_narrows_with_more_rows():
    rows = row_metrics(PREDICTIONS, REFERENCES, ["exact_match_normalized", "rouge_l"])
    few = summarize(rows, (PREDICTIONS, REFERENCES), resamples=500, confidence=0.9, seed=1)
    many_rows = {k: v * 8 for k, v in rows.items()}
    many = summarize(many_rows, (PREDICTIONS * 8, REFERENCES * 8), resamples=500, confidence=0.9, seed=1)
    for metric in ("exact_match_normalized", "rouge_l", "bleu"):
        assert few[f"{metric}/ci_low"] <= few[metric] <= few[f"{metric}/ci_high"]
        if metric != "bleu":  # BLEU's smoothing of orders with no match depends on the corpus size
            assert many[metric] == pytest.approx(few[metric])
        assert (many[f"{metric}/ci_high"] - many[f"{metric}/ci_low"]
                < 0.6 * (few[f"{metric}/ci_high"] - few[f"{metric}/ci_low"]))
    wider = summarize(rows, None, resamples=500, confidence=0.99, seed=1)
    assert wider["rouge_l/ci_high"] - wider["rouge_l/ci_low"] >= few["rouge_l/ci_high"] - few["rouge_l/ci_low"]

    same = summarize({"rouge_l": [0.25] * 9}, (["a b c"] * 9, ["a b d"] * 9), resamples=200, confidence=0.95, seed=0)
    assert same["rouge_l/ci_low"] == same["rouge_l/ci_high"] == pytest.approx(0.25)
    assert same["bleu/ci_low"] == pytest.approx(same["bleu"]) and same["bleu/ci_high"] == pytest.approx(same["bleu"])


def test_bleu_of_answers_too_short_for_4_grams_is_zero_and_says_so():
    warnings = []
    answers = ["the fish", "the cat"]
    report = summarize({}, (answers, answers), resamples=0, confidence=0.95, seed=0, warn=warnings.append)
    assert report["bleu"] == sacrebleu.corpus_bleu(answers, [answers]).score == 0
    assert len(warnings) == 1 and warnings[0].startswith("bleu: no answer has 4 tokens")
    summarize({}, (PREDICTIONS, REFERENCES), resamples=0, confidence=0.95, seed=0, warn=warnings.append)
    assert len(warnings) == 1


def test_bleu_bootstrap_samples_equal_sacrebleu_on_the_resampled_rows():
    indices = resample(len(PREDICTIONS), 5, seed=3)
    point, samples = corpus_bleu(PREDICTIONS, REFERENCES, indices)
    assert point.score == pytest.approx(sacrebleu.corpus_bleu(PREDICTIONS, [REFERENCES]).score)
    for picked, value in zip(indices, samples):
        hyps, refs = [PREDICTIONS[i] for i in picked], [REFERENCES[i] for i in picked]
        assert value == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score)


def check(**options):
    return Generation(Generation.Options(**options)).check(plan=None)


def test_check_finds_bad_options_without_loading_anything(monkeypatch):
    assert check() == [] and check(pattern="[A-D]", do_sample=True, temperature=0.7, top_k=5) == []
    assert check(pattern="([a-z")[0].startswith("pattern: not a valid regular expression")
    assert check(metrics=["format"]) == [
        "metrics: 'format' needs pattern = \"<regular expression>\" that every answer should match"]
    assert check(metrics=["bleu"], pattern="x") == [
        "pattern: is used by the metric 'format' only, which metrics leaves out"]
    assert check(temperature=0.5) == ["temperature: applies only when sampling; set do_sample = true"]
    with pytest.raises(ValueError):
        Generation.Options(confidence=1.0)
    # The libraries are installed here; hide one to see the message a user without the extra gets.
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sacrebleu" else real(name, *a))
    assert check() == ["metrics: bleu needs the package sacrebleu, which is not installed: "
                       "pip install 'ftcore[eval]'; or choose metrics = [...]"]
    assert check(metrics=["rouge_l"]) == []


def evaluate(evaluator, model, tokenizer, template, rows, out_dir=None):
    import datasets

    from ftcore.context import EvalContext, RunInfo

    ctx = EvalContext(RunInfo(plan=None, run_dir=out_dir), quiet_reporter(), "before", model, tokenizer, template,
                      datasets.Dataset.from_list(rows), out_dir)
    return evaluator.evaluate(ctx)


def test_sampling_is_reproducible_and_leaves_the_run_random_state_alone(tiny_model, tmp_path):
    model, tokenizer, template = tiny_model
    rows = [{"prompt": f"the {w} cat", "completion": " sees the dog"} for w in ("red", "blue", "tree", "stone")]

    def predictions(seed, name):
        folder = tmp_path / name
        folder.mkdir()
        ev = Generation(Generation.Options(do_sample=True, temperature=1.5, top_k=0, seed=seed, max_new_tokens=6,
                                           metrics=["exact_match", "rouge_l"], bootstrap=0, batch_size=3))
        evaluate(ev, model, tokenizer, template, rows, folder)
        return [json.loads(line)["prediction"] for line in (folder / "predictions.jsonl").open()]

    state = torch.get_rng_state()
    first = predictions(1, "a")
    assert torch.equal(torch.get_rng_state(), state)
    assert predictions(1, "b") == first
    assert predictions(2, "c") != first


def test_exact_match_is_generation_reduced_to_exact_match(tiny_model, tmp_path):
    from ftcore_plugins.evaluators.exact_match import ExactMatch

    model, tokenizer, template = tiny_model
    rows = chat_rows(6, seed=5)
    rows.append({"messages": [{"role": "user", "content": "no answer here"}]})  # left out: nothing to compare
    strict = evaluate(ExactMatch(ExactMatch.Options(normalize=False, max_new_tokens=4)), model, tokenizer, template,
                      rows, tmp_path)
    records = [json.loads(line) for line in (tmp_path / "predictions.jsonl").open()]
    general = evaluate(Generation(Generation.Options(max_new_tokens=4, metrics=["exact_match"], bootstrap=0)),
                       model, tokenizer, template, rows, tmp_path)
    assert strict == general == {"exact_match": sum(r["exact_match"] for r in records) / 6, "n": 6}
    assert [r["reference"] for r in records] == [r["messages"][-1]["content"] for r in rows[:6]]


PLAN = """
[run]
name = "gen"
seed = 3

[model]
use = "hf"
path = "model"

[template]
use = "chatml"

[data.eval]
use = "jsonl"
path = "eval.jsonl"

[[evaluate]]
use = "generation"
data = "eval"
when = "before"
max_new_tokens = 6
batch_size = 4
pattern = "the \\\\w+"
bootstrap = 300
"""


@pytest.mark.slow
def test_run_writes_predictions_equal_to_greedy_generate_and_true_metrics(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import copy

    model, tokenizer, template = tiny_model
    # The random model's greedy answer is a run of newlines, which strips to nothing: make every token
    # that decodes to blanks unlikely (logit 0), so that the answers are words to compare.
    model = copy.deepcopy(model)
    blank = [i for i in range(len(tokenizer)) if not tokenizer.decode([i], skip_special_tokens=True).strip()]
    with torch.no_grad():
        model.get_output_embeddings().weight[blank] = 0
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    rows = chat_rows(10, seed=2)
    write_jsonl(tmp_path / "eval.jsonl", rows)
    (tmp_path / "plan.toml").write_text(PLAN, encoding="utf-8")
    result = run_cli("run", str(tmp_path / "plan.toml"))
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "runs" / "gen"
    records = [json.loads(line) for line in (run / "evaluations" / "before" / "generation" / "predictions.jsonl").open()]
    report = json.loads((run / "evaluations" / "before.json").read_text())["generation"]

    # One prompt at a time, no padding: the same answers as the evaluator's left-padded batches.
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    tok = AutoTokenizer.from_pretrained(tmp_path / "model")
    stops = [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
    for row, record in zip(rows, records, strict=True):
        prompt = template.render(row["messages"][:-1], tok, add_generation_prompt=True)
        ids = tok(prompt, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            out = plain.generate(**ids, do_sample=False, max_new_tokens=6, eos_token_id=stops,
                                 pad_token_id=tok.pad_token_id)
        assert record["prompt"] == prompt
        assert record["reference"] == row["messages"][-1]["content"]
        assert record["prediction"] == tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()

    predictions, references = [r["prediction"] for r in records], [r["reference"] for r in records]
    assert any(predictions)
    scorer = rouge_scorer.RougeScorer(["rougeL"])
    assert report["n"] == 10
    assert report["rouge_l"] == pytest.approx(sum(scorer.score(r, p)["rougeL"].fmeasure
                                                  for p, r in zip(predictions, references)) / 10)
    assert report["bleu"] == pytest.approx(sacrebleu.corpus_bleu(predictions, [references]).score)
    assert report["format"] == pytest.approx(sum(bool(__import__("re").fullmatch(r"the \w+", p))
                                                 for p in predictions) / 10)
    for metric in ALL:
        assert report[f"{metric}/ci_low"] <= report[metric] <= report[f"{metric}/ci_high"]


@pytest.mark.parametrize("name, stops", [("gemma-cropped", ["<eos>", "<end_of_turn>"]), ("llama3", ["<|eot_id|>"]),
                                         ("qwen25", ["<|im_end|>"])])
def test_a_native_template_stops_where_its_turns_end(name, stops):
    """A template that declares no stop token (native, jinja) stops where its rendering closes an assistant
    turn, the token its labels train: Gemma's EOS is <eos>, but its turns end with <end_of_turn>."""
    from conftest import SHARED
    from transformers import AutoTokenizer

    from ftcore_plugins.common.chat import stop_token_ids
    from ftcore_plugins.templates.native import NativeTemplate

    folder = SHARED / "tokenizers" / name
    if not folder.is_dir():
        pytest.skip(f"{folder} is absent")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = stop_token_ids(tokenizer, NativeTemplate(NativeTemplate.Options()))
    assert tokenizer.convert_ids_to_tokens(ids) == stops
