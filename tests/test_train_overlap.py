"""The train/eval overlap check (``ftcore_plugins.data._overlap``): evaluation rows whose prompt repeats a
training row's, exactly or nearly, are counted in the data report and ``ftcore validate --data``, warned
about, and left out under ``train_overlap = "drop"``."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from conftest import ROOT, run_cli

from ftcore_plugins.data._overlap import EvalIndex, prompt_text

QUESTION = "Which word is an animal? {}"


def chat(words: str, answer: str = "the cat", images: list[str] | None = None) -> dict:
    row = {"messages": [{"role": "system", "content": "Answer briefly."},
                        {"role": "user", "content": QUESTION.format(words)},
                        {"role": "assistant", "content": answer}]}
    return {**row, "images": images} if images else row


def overlap(eval_rows: list[dict], train_rows: list[dict], threshold: float = 0.8) -> tuple[list[int], list[int]]:
    exact, near = EvalIndex(eval_rows, threshold).compare(train_rows)
    return [i for i, hit in enumerate(exact) if hit], [i for i, hit in enumerate(near) if hit]


def test_the_prompt_as_its_user_wrote_it_is_compared_not_the_answer_nor_the_roles():
    assert prompt_text(chat("cat  Red TREE")) == "which word is an animal? cat red tree"
    assert prompt_text(chat("cat red tree")) == prompt_text({"prompt": "which word is an animal?\tcat red tree",
                                                             "completion": "the dog"})
    assert prompt_text({"prompt": [{"role": "user", "content": "Hi"}], "chosen": [], "rejected": []}) == "hi"
    assert prompt_text({"text": "The Red  fox."}) == "the red fox."


def test_exact_and_near_repeats_are_told_apart_and_a_different_question_is_neither():
    train = [chat("cat red tree"), chat("dog blue river"), chat("fox old king")]
    eval_rows = [
        chat("CAT red  tree", answer="the dog"),  # the same question, another answer: exact
        chat("dog blue river please"),  # one word more at the end: 6 of 7 shingles shared, near
        chat("fox old queen"),  # the last word changed: 5 of 7 shared (0.71), another question
        chat("horse green stone"),
    ]
    assert overlap(eval_rows, train) == ([0], [1])
    assert overlap(eval_rows, train, threshold=0.7) == ([0], [1, 2])  # the threshold decides
    assert overlap(eval_rows, []) == ([], [])


def test_the_same_question_about_another_image_is_no_overlap():
    train = [chat("cat red tree", images=["a.png"])]
    eval_rows = [chat("cat red tree", images=["a.png"]), chat("cat red tree", images=["b.png"]),
                 chat("cat red tree please", images=["b.png"])]
    assert overlap(eval_rows, train) == ([0], [])


# -- the quickstart, with 50 of its 100 eval rows taken from training --------------------------------------

def _quickstart(tmp_path, drop: bool = False):
    """A copy of examples/quickstart whose eval.jsonl holds 48 training rows (some with other case and spacing),
    2 training prompts with a word added, and 50 of its own held-out rows; the plan trains 2 steps a stage
    and exports nothing, so a run takes seconds."""
    project = tmp_path / "quickstart"
    shutil.copytree(ROOT / "examples" / "quickstart", project, ignore=shutil.ignore_patterns("runs"))
    data = project / "data"
    train = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    held_out = [json.loads(line) for line in (data / "eval.jsonl").read_text().splitlines()]
    copied = [json.loads(json.dumps(row)) for row in train[:48]]
    for row in copied[:10]:
        row["messages"][0]["content"] = "  " + row["messages"][0]["content"].upper()
    near = [json.loads(json.dumps(row)) for row in train[100:102]]
    for row in near:
        row["messages"][0]["content"] += " please"
    rows = copied + near + held_out[:50]
    (data / "eval.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    plan = (project / "plan.toml").read_text()
    plan = plan.replace("epochs = 3", "max_steps = 2").replace("epochs = 10", "max_steps = 2")
    plan = plan.split("[[export]]")[0]
    if drop:
        plan = plan.replace('path = "data/eval.jsonl"', 'path = "data/eval.jsonl"\ntrain_overlap = "drop"')
    (project / "plan.toml").write_text(plan)
    return project, [row["messages"][0]["content"] for row in held_out[:50]]


WARNING = "50 of 100 rows of eval source 'eval' repeat training rows of 'train' (48 exact, 2 near)"


@pytest.mark.slow
def test_validate_data_reports_the_eval_rows_that_repeat_training_rows(tmp_path):
    project, _ = _quickstart(tmp_path)
    result = run_cli("validate", "--data", str(project / "plan.toml"))
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    assert f"data.eval: warning: {WARNING}" in lines
    assert not [line for line in lines if "'corpus'" in line or "drop" in line]  # no overlap with the corpus


@pytest.mark.slow
def test_a_run_counts_the_overlap_in_its_data_report_and_drop_evaluates_on_the_rest(tmp_path):
    project, held_out = _quickstart(tmp_path, drop=True)
    result = run_cli("run", str(project / "plan.toml"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"warning: {WARNING}" in result.stderr.splitlines()
    assert re.search(r"data eval: dropped 50 rows that repeat training rows .*; 50 left", result.stdout)
    run = project / "runs" / "quickstart"
    report = json.loads((run / "data_report.json").read_text())["source/eval"]
    assert report["train_overlap"] == {"corpus": {"rows": 100, "exact": 0, "near": 0},
                                       "train": {"rows": 100, "exact": 48, "near": 2}}
    assert report["dropped_train_overlap"] == 50 and report["rows_kept"] == 50
    evaluations = json.loads((run / "summary.json").read_text())["evaluations"]
    assert evaluations["before"]["exact_match"]["n"] == evaluations["after"]["exact_match"]["n"] == 50
    predictions = (run / "evaluations" / "after" / "exact_match" / "predictions.jsonl").read_text().splitlines()
    asked = [re.search(r"user\n(.*?)<\|im_end\|>", json.loads(line)["prompt"]).group(1) for line in predictions]
    assert sorted(asked) == sorted(held_out)  # the held-out rows, each once, and no repeated one


def test_drop_on_data_no_evaluation_reads_is_a_plan_error(tmp_path):
    project, _ = _quickstart(tmp_path)
    plan = project / "plan.toml"
    plan.write_text(plan.read_text().replace('path = "data/train.jsonl"',
                                             'path = "data/train.jsonl"\ntrain_overlap = "drop"'))
    result = run_cli("validate", str(plan))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"{plan}: data.train.train_overlap: \"drop\" leaves out the evaluation rows that repeat training rows, "
        "but stage 'sft' trains on data.train"]
