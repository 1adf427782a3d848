"""`ftcore generate`: a run's model answers a JSONL file of prompts, as its evaluator would."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import run_cli, write_jsonl


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def generate(run, tmp_path, name, *args, rows_file=None):
    out = tmp_path / f"{name}.jsonl"
    result = run_cli("generate", str(run), "--input", str(rows_file or run.parent.parent / "data" / "eval.jsonl"),
                     "--output", str(out), *args)
    assert result.returncode == 0, result.stderr[-3000:]
    return read_jsonl(out), result


# -- the acceptance check: the evaluator's answers and score, from the run's files alone ----------------

@pytest.mark.slow
def test_generate_reproduces_the_runs_evaluation(quickstart_run, tmp_path):
    run = quickstart_run
    after = json.loads((run / "evaluations" / "after.json").read_text())["exact_match"]
    predictions = read_jsonl(run / "evaluations" / "after" / "exact_match" / "predictions.jsonl")
    # The plan's exact_match evaluator: max_new_tokens 8, batches of 16, greedy.
    rows, result = generate(run, tmp_path, "final", "--max-new-tokens", "8")
    assert len(rows) == len(predictions) == after["n"] == 100
    assert [r["prompt"] for r in rows] == [p["prompt"] for p in predictions]  # the run's chatml template
    assert [r["answer"] for r in rows] == [p["prediction"] for p in predictions]
    assert [r["reference"] for r in rows] == [p["reference"] for p in predictions]
    score = sum(r["answer"].lower() == r["reference"].lower() for r in rows) / len(rows)
    # The run's own score, whatever it is: the quickstart's varies with threads and load (test_quickstart
    # holds its floor), and generate must reproduce it.
    assert score == after["exact_match"] >= 0.5
    assert f"{score:.4f} ignoring case and spaces" in result.stderr

    # The base model, rebuilt from the run's files, answers as the evaluator saw it before training.
    before = read_jsonl(run / "evaluations" / "before" / "exact_match" / "predictions.jsonl")
    rows, _ = generate(run, tmp_path, "base", "--stage", "base", "--max-new-tokens", "8")
    assert [r["answer"] for r in rows] == [p["prediction"] for p in before]


@pytest.mark.slow
def test_exports_and_stages_answer_like_the_final_model(quickstart_run, tmp_path):
    run = quickstart_run
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [
        {"prompt": "Which word is an animal? old fox tree", "id": "a"},
        {"messages": [{"role": "system", "content": "Answer briefly."},
                      {"role": "user", "content": "Which word is an animal? cow blue runs"}]},
        {"prompt": [{"role": "user", "content": "Which word is an animal? sees horse dark"}], "completion": "the horse"},
    ])
    final, _ = generate(run, tmp_path, "final", "--max-new-tokens", "8", rows_file=prompts)
    assert final[0]["id"] == "a" and "id" not in final[1]
    assert final[0]["prompt"] == "<|im_start|>user\nWhich word is an animal? old fox tree<|im_end|>\n" \
                                 "<|im_start|>assistant\n"
    assert final[0]["answer"] == "the fox" and final[2]["answer"] == "the horse"
    assert final[2]["reference"] == "the horse" and "reference" not in final[0]
    for which in (("--stage", "sft"), ("--export", "merged"), ("--export", "adapter")):
        rows, _ = generate(run, tmp_path, "-".join(which), *which, "--max-new-tokens", "8", rows_file=prompts)
        assert [r["answer"] for r in rows] == [r["answer"] for r in final], which
    pretrained, _ = generate(run, tmp_path, "pretrain", "--stage", "pretrain", "--max-new-tokens", "8",
                             rows_file=prompts)
    assert [r["answer"] for r in pretrained] != [r["answer"] for r in final]  # SFT changed the answers


@pytest.mark.slow
def test_sampling_is_reproducible_with_a_seed_and_greedy_by_default(quickstart_run, tmp_path):
    run = quickstart_run
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"Which word is an animal? {w}"}
                                                       for w in ("red cat tree", "dog runs blue", "sees old bird")])
    sample = ("--stage", "base", "--temperature", "1.0", "--top-p", "0.95", "--max-new-tokens", "12")
    first, _ = generate(run, tmp_path, "s1", *sample, "--seed", "3", rows_file=prompts)
    again, _ = generate(run, tmp_path, "s2", *sample, "--seed", "3", rows_file=prompts)
    other, _ = generate(run, tmp_path, "s3", *sample, "--seed", "4", rows_file=prompts)
    greedy, _ = generate(run, tmp_path, "g", "--stage", "base", "--max-new-tokens", "12", rows_file=prompts)
    assert first == again
    # The untrained model's distribution is nearly flat: other seeds, and argmax, pick other words.
    assert first != other and first != greedy


@pytest.mark.slow
def test_output_is_never_overwritten_without_force(quickstart_run, tmp_path):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "Which word is an animal? red cat tree"}])
    out = tmp_path / "answers.jsonl"
    out.write_text("mine\n")
    args = ("generate", str(quickstart_run), "--input", str(prompts), "--output", str(out), "--max-new-tokens", "4")
    result = run_cli(*args)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == \
        f"error: {out} already exists; pass --force to overwrite it, or choose another --output"
    assert out.read_text() == "mine\n"
    assert run_cli(*args, "--force").returncode == 0
    assert read_jsonl(out)[0]["answer"] == "the cat"


# -- bad input: one line naming the file and the line, exit 2, before any model loads --------------------

@pytest.mark.parametrize("lines, message", [
    (['{"prompt": "hi"}', '{"prompt": "ok"', '{"prompt": "x"}'],
     "{f}:2: not valid JSON: Expecting ',' delimiter (column 16)"),
    (['{"prompt": "hi"}', '', '{"question": "no prompt"}'],
     "{f}:3: no prompt: give prompt (a string or a list of messages), messages, conversations (ShareGPT), or "
     "instruction/output (Alpaca) (the row has: question)"),
    (['["a", "list"]'], "{f}:1: expected an object with prompt (a string or a list of messages), messages, "
                        "conversations (ShareGPT), or instruction/output (Alpaca); got list"),
    (['{"prompt": ""}'], "{f}:1: 'prompt' is empty"),
    (['{"messages": [{"role": "robot", "content": "hi"}]}'], None),
    (['{"messages": [{"role": "assistant", "content": "only an answer"}]}'],
     "{f}:1: the conversation has only an answer, no prompt before it"),
    (['{"prompt": "hi", "completion": 3}'], "{f}:1: 'completion' (the reference answer) must be a string"),
])
def test_bad_input_rows_are_one_line_naming_the_line(tmp_path, lines, message):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text("\n".join(lines) + "\n", encoding="utf-8")
    result = run_cli("generate", str(tmp_path / "run"), "--input", str(bad), "--output", str(tmp_path / "o.jsonl"))
    assert result.returncode == 2
    lines_out = result.stderr.strip().splitlines()
    assert len(lines_out) == 1 and "Traceback" not in result.stderr
    if message is None:  # the data layer's own message for a bad message role
        assert lines_out[0].startswith(f"error: {bad}:1: ") and "robot" in lines_out[0], lines_out
    else:
        assert lines_out[0] == "error: " + message.format(f=bad)
    assert not (tmp_path / "o.jsonl").exists()


def test_missing_input_and_bad_options(tmp_path):
    out = str(tmp_path / "o.jsonl")
    result = run_cli("generate", str(tmp_path), "--input", str(tmp_path / "nope.jsonl"), "--output", out)
    assert (result.returncode, result.stderr.strip()) == (2, f"error: {tmp_path / 'nope.jsonl'}: no such input file")
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    result = run_cli("generate", str(tmp_path / "nope"), "--input", str(prompts), "--output", out)
    assert (result.returncode, result.stderr.strip()) == (2, f"error: {tmp_path / 'nope'}: no such run directory")
    result = run_cli("generate", str(tmp_path), "--input", str(prompts), "--output", out, "--top-p", "0")
    assert (result.returncode, result.stderr.strip()) == (2, "error: --top-p must be in (0, 1], got 0.0")
    result = run_cli("generate", str(tmp_path), "--input", str(prompts), "--output", out, "--batch-size", "0")
    assert (result.returncode, result.stderr.strip()) == (2, "error: --batch-size must be >= 1, got 0")
    # Beyond any model's context: refused before anything loads (a run's model caps what is within it).
    result = run_cli("generate", str(tmp_path), "--input", str(prompts), "--output", out, "--max-new-tokens",
                     "100000000")
    assert (result.returncode, result.stderr.strip()) == \
        (2, "error: --max-new-tokens must be at most 16,777,216 (more than any model's context), got 100,000,000")


@pytest.mark.slow
def test_max_new_tokens_beyond_the_context_is_capped_as_chat_caps_it(quickstart_run, tmp_path):
    """The quickstart's model takes 256 positions: --max-new-tokens 100000 is capped at 256, with chat's
    note on stderr, and the answers are those of a smaller budget (greedy, they stop by themselves)."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Which word is an animal? red cat tree"}])
    rows, result = generate(quickstart_run, tmp_path, "long", "--max-new-tokens", "100000", rows_file=prompts)
    assert "(--max-new-tokens 100000 is beyond the model's context of 256 tokens: capped at 256)" in result.stderr
    assert "greedy max_new_tokens=256" in result.stderr
    assert rows[0]["answer"] == "the cat"


@pytest.mark.slow
def test_unfinished_and_missing_runs_and_exports(quickstart_run, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])

    def err(run, *args):
        result = run_cli("generate", str(run), "--input", str(prompts), "--output", str(tmp_path / "o.jsonl"), *args)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
        return result.stderr.strip().splitlines()[-1]

    assert err(tmp_path) == f"error: {tmp_path}: not an ftcore run directory (no readable manifest.json)"
    run = quickstart_run
    assert err(run, "--stage", "sfft") == \
        f"error: {run}: no stage named 'sfft' (stages: base, pretrain, sft); did you mean 'sft'?"
    assert err(run, "--export", "gguf") == f"error: {run}: the plan has no export named 'gguf' (exports: merged, adapter)"

    # A copy whose SFT never finished and whose merged export was not written.
    broken = tmp_path / "broken"
    shutil.copytree(run, broken, ignore=shutil.ignore_patterns("checkpoints"))
    (broken / "stages" / "sft" / "COMPLETE.json").unlink()
    shutil.rmtree(broken / "exports" / "merged")
    plan = json.loads((run / "manifest.json").read_text())["plan_path"]
    assert err(broken) == (f"error: {broken}: the run has not finished stage 'sft' (status: complete); choose a "
                           f"finished one with --stage pretrain, or finish it with: ftcore run {plan} --resume")
    assert err(broken, "--stage", "sft") == (f"error: {broken}: stage 'sft' has not finished (no stages/sft/"
                                             f"COMPLETE.json); finish it with: ftcore run {plan} --resume")
    assert err(broken, "--export", "merged") == (f"error: {broken}: export 'merged' was not written "
                                                 f"({broken / 'exports' / 'merged'} is missing); finish the run "
                                                 f"with: ftcore run {plan} --resume")
