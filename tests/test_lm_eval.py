"""The `lm_eval` evaluator runs a tiny local lm-evaluation-harness task on the model in memory; its
accuracy equals our own log-likelihood comparison of the choices with the same model."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from conftest import ANIMALS, OTHERS, run_cli, write_jsonl  # noqa: E402
from test_evaluators import quiet_reporter, tiny_model  # noqa: E402, F401  (the shared tiny scratch model)

TASK = """task: tiny_animals
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: which is an animal? Answer:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def task_folder(folder, n=10):
    """A task folder: ten four-way questions, one animal among three other words."""
    import random

    rng = random.Random(4)
    rows = []
    for _ in range(n):
        choices = [rng.choice(ANIMALS), *rng.sample(OTHERS, 3)]
        rng.shuffle(choices)
        rows.append({"choices": choices, "answer": next(i for i, c in enumerate(choices) if c in ANIMALS)})
    folder.mkdir()
    write_jsonl(folder / "data.jsonl", rows)
    (folder / "tiny_animals.yaml").write_text(TASK.format(data=folder / "data.jsonl"), encoding="utf-8")
    return rows


def own_accuracy(model, tokenizer, rows, context="Question: which is an animal? Answer:"):
    """acc and acc_norm (log-likelihood per character of the choice) by scoring each choice alone."""
    right = right_norm = 0
    with torch.no_grad():
        for row in rows:
            scores = []
            for choice in row["choices"]:
                context_ids = tokenizer.encode(context)
                whole = tokenizer.encode(context + " " + choice)
                assert whole[:len(context_ids)] == context_ids
                logp = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), -1)
                scores.append(sum(logp[i - 1, whole[i]].item() for i in range(len(context_ids), len(whole))))
            right += max(range(4), key=scores.__getitem__) == row["answer"]
            normed = [s / len(" " + c) for s, c in zip(scores, row["choices"])]
            right_norm += max(range(4), key=normed.__getitem__) == row["answer"]
    return right / len(rows), right_norm / len(rows)


def test_tiny_local_task_accuracy_equals_own_loglikelihood_comparison(tiny_model, tmp_path):
    pytest.importorskip("lm_eval")

    from ftcore.context import EvalContext, RunInfo
    from ftcore_plugins.evaluators.lm_eval import LmEval

    model, tokenizer, template = tiny_model
    rows = task_folder(tmp_path / "tasks")
    out = tmp_path / "out"
    out.mkdir()
    model.train()
    state = torch.get_rng_state()
    ev = LmEval(LmEval.Options(tasks=["tiny_animals"], include_path=tmp_path / "tasks", batch_size=3))
    got = ev.evaluate(EvalContext(RunInfo(plan=None, run_dir=tmp_path), quiet_reporter(), "after", model, tokenizer,
                                  template, None, out))
    assert model.training and torch.equal(torch.get_rng_state(), state)
    model.eval()
    acc, acc_norm = own_accuracy(model, tokenizer, rows)
    assert got["tiny_animals/n"] == 10
    assert got["tiny_animals/acc"] == pytest.approx(acc)
    assert got["tiny_animals/acc_norm"] == pytest.approx(acc_norm)
    assert "tiny_animals/acc_stderr" in got
    saved = json.loads((out / "results.json").read_text())
    assert saved["results"]["tiny_animals"]["acc,none"] == pytest.approx(acc)
    assert len((out / "samples_tiny_animals.jsonl").read_text().splitlines()) == 10


def test_missing_package_is_named_with_the_extra_at_validation(monkeypatch):
    import importlib.util

    from ftcore_plugins.evaluators.lm_eval import LmEval

    ev = LmEval(LmEval.Options(tasks=["x"]))
    if importlib.util.find_spec("lm_eval") is not None:
        assert ev.check(plan=None) == []
    # Hide the installed package to see what a user without the extra is told.
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a))
    assert ev.check(plan=None) == ["use: evaluator 'lm_eval' needs lm-eval (lm-evaluation-harness), which is not "
                                   "installed: pip install 'ftcore[lm-eval]'"]


PLAN = """
[run]
name = "lm"

[model]
use = "hf"
path = "model"

[[evaluate]]
use = "lm_eval"
when = "before"
tasks = ["tiny_animals"]
include_path = "{tasks}"
batch_size = 4
"""


@pytest.mark.slow
def test_plan_runs_a_local_task_through_the_cli(tiny_model, tmp_path):
    pytest.importorskip("lm_eval")
    model, tokenizer, _ = tiny_model
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    rows = task_folder(tmp_path / "tasks")
    (tmp_path / "bad.toml").write_text(PLAN.format(tasks="nope"), encoding="utf-8")
    bad = run_cli("validate", str(tmp_path / "bad.toml"))
    assert bad.returncode == 2 and "evaluate[0].include_path: no such file or folder" in bad.stdout + bad.stderr
    (tmp_path / "plan.toml").write_text(PLAN.format(tasks="tasks"), encoding="utf-8")  # relative to the plan
    result = run_cli("run", str(tmp_path / "plan.toml"), cwd=tmp_path.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "runs" / "lm" / "evaluations" / "before.json").read_text())["lm_eval"]
    model.eval()
    acc, acc_norm = own_accuracy(model, tokenizer, rows)
    assert report["tiny_animals/acc"] == pytest.approx(acc) and report["tiny_animals/acc_norm"] == pytest.approx(acc_norm)
    assert (tmp_path / "runs" / "lm" / "evaluations" / "before" / "lm_eval" / "results.json").exists()
