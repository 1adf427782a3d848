"""``ftcore check``: passes on every example plan, and each seeded fault gives its own line."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import ROOT, chat_rows, run_cli, write_jsonl

pytestmark = pytest.mark.slow

SFT = """
[[stage]]
name = "sft"
trainer = "sft"
data = "chat"
batch_size = 4
{extra}
"""


def failed_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("check failed:")]


@pytest.mark.parametrize("example", ["quickstart", "dpo", "rlhf", "sweep"])
def test_check_passes_on_every_example_plan_and_writes_no_run(tmp_path, example):
    for name in {"quickstart", example}:  # the dpo and rlhf plans read the quickstart's data
        shutil.copytree(ROOT / "examples" / name, tmp_path / name, ignore=shutil.ignore_patterns("runs"))
    project = tmp_path / example
    r = run_cli("check", str(project / "plan.toml"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "all checks passed" in r.stdout and not failed_lines(r)
    assert "trained / not trained" in r.stdout and "row 1:" in r.stdout  # the labelled rows are shown
    assert "overfit one batch" in r.stdout
    assert not (project / "runs").exists()  # a check writes no run folder


def test_a_template_that_renders_no_answer_is_its_own_line(tiny_project):
    (tiny_project.dir / "no_answers.jinja").write_text(
        "{% for m in messages %}<|{{ m.role }}|>{% if m.role != 'assistant' %}{{ m.content }}{% endif %}\n"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    plan = tiny_project(SFT.format(extra="learning_rate = 1e-2"))
    plan.write_text(plan.read_text().replace('[template]\nuse = "chatml"',
                                             '[template]\nuse = "jinja"\npath = "no_answers.jinja"'))
    r = run_cli("check", str(plan))
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    lines = failed_lines(r)
    # The template renders, but no answer is in it: every label is masked, and no row is left to learn from.
    assert len(lines) == 1 and "stage sft: data:" in lines[0] and "left with a token to learn" in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_a_learning_rate_of_zero_is_refused_in_one_line(tiny_project):
    plan = tiny_project(SFT.format(extra="learning_rate = 0"))
    r = run_cli("check", str(plan))
    assert r.returncode == 2 and "learning_rate" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_learning_rate_too_small_to_learn_fails_the_overfit_and_says_why(tiny_project):
    plan = tiny_project(SFT.format(extra='learning_rate = 1e-9\nadapter = "full"'))
    r = run_cli("check", str(plan), "--steps", "5")
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    lines = failed_lines(r)
    assert len(lines) == 1 and "did not overfit" in lines[0], r.stderr
    assert "learning_rate 1e-09 is too small" in lines[0]


def test_target_modules_that_match_nothing_are_their_own_line(tiny_project):
    plan = tiny_project(SFT.format(extra='adapter = { use = "lora", r = 4, target_modules = ["no_such_proj"] }'))
    r = run_cli("check", str(plan))
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    lines = failed_lines(r)
    assert len(lines) == 1 and "stage sft: adapter:" in lines[0] and "no_such_proj" in lines[0], r.stderr


def test_a_healthy_tiny_stage_passes_and_learns_the_batch(tiny_project):
    plan = tiny_project(SFT.format(extra='learning_rate = 1e-2\nadapter = "full"'))
    r = run_cli("check", str(plan), "--steps", "20")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    line = next(line for line in r.stdout.splitlines() if line.startswith("overfit one batch"))
    first, last = (float(x) for x in line.rsplit("loss ", 1)[1].split(" -> "))
    assert last < 0.75 * first  # what "passes" means, read back from the printed losses


def test_check_and_lr_find_on_a_real_tokenizer_and_its_native_template(tmp_path, qwen25_tiny_model):
    """The Qwen2.5 tokenizer from ../shared with its own chat template (which adds a default system
    prompt): the rows check renders train the answers alone, and lr-find suggests a rate."""
    write_jsonl(tmp_path / "chat.jsonl", chat_rows(24))
    plan = tmp_path / "plan.toml"
    plan.write_text("""
[model]
use = "hf"
path = "base-model"
dtype = "float32"

[template]
use = "native"

[data.chat]
use = "jsonl"
path = "chat.jsonl"

[[stage]]
trainer = "sft"
data = "chat"
adapter = "full"   # a LoRA of 2k parameters on a random 1-layer model cannot overfit a 152k vocabulary
batch_size = 4
learning_rate = 1e-2
""")
    r = run_cli("check", str(plan))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "all checks passed" in r.stdout and "<|im_start|>system" in r.stdout  # Qwen2.5's own rendering
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen25_tiny_model)
    first = chat_rows(1)[0]["messages"]
    answer = len(tok(first[-1]["content"] + "<|im_end|>", add_special_tokens=False).input_ids)
    total = len(tok.apply_chat_template(first, tokenize=True, return_dict=True)["input_ids"])
    # The first row: the conversation as the tokenizer renders it; the answer and its end-of-turn token train.
    assert f"row 1: {total} tokens, {answer} trained" in r.stdout, r.stdout[:3000]
    found = run_cli("lr-find", str(plan), "--steps", "30", "--json", "--plot", str(tmp_path / "lr.png"))
    assert found.returncode == 0, found.stderr[-3000:]
    assert 1e-7 < json.loads(found.stdout.strip().splitlines()[-1])["suggestion"] < 1
