"""``ftcore validate --data``: every row the stages use, read, converted and rendered with the
plan's template; each bad row as ``data.<name>: FILE:LINE: message``, then a summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_sources import datasets_cache  # noqa: F401  (autouse: a private datasets cache)

from ftcore.cli import main

# Renders ChatML, and refuses any message that says "boom": a row that converts but cannot be rendered.
TEMPLATE = ("{% for m in messages %}{% if 'boom' in m['content'] %}{{ raise_exception('no boom here') }}{% endif %}"
            "<|im_start|>{{ m['role'] }}\n{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>"
            "{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def u(text):
    return {"role": "user", "content": text}


def a(text):
    return {"role": "assistant", "content": text}


GOOD = {"messages": [u("Hi"), a("Hello!")]}
ROWS = [
    GOOD,
    {"messages": [u("Hi"), a("")]},
    '{"messages": [}',
    {"messages": [a("x"), a("y"), u("z")]},
    {"messages": [u("Dear {{name}}"), a("ok")]},
    {"messages": [u("boom"), a("ok")]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "value": "i"}]},
                  a("ok")]},
    {"messages": [u("Hi"), {"role": "assistant", "content": "ok", "thinking": "hm"}]},
    GOOD,
]
LINES = [
    "data/chat.jsonl:2: 'messages[1]' is an assistant turn with empty content (and no tool_calls): it would train on "
    "the end-of-turn token alone",
    "data/chat.jsonl:3: invalid JSON: Expecting value (column 15)",
    "data/chat.jsonl:4: 'messages[1]' is a second assistant turn in a row; merge them into one message",
    "data/chat.jsonl:6: cannot render with the template: template 'jinja' (t.jinja) cannot render this "
    "conversation: no boom here",
    "data/chat.jsonl:7: 'messages[0].content[1]' has 'value'; text parts need 'text'",
]
PLACEHOLDER = ("warning: 1 row(s) hold unfilled template placeholders, trained as they are (first: "
               "data/chat.jsonl:5: 'messages[0].content' holds '{{name}}'); set placeholders = \"error\" to reject "
               "them or \"allow\" to silence this")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A small saved tokenizer: what the plan's model names, no hub and no fixtures needed."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["Hello there, how are you?"], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(folder)
    return folder


def project(folder: Path, tokenizer: Path | str, rows: list, source: str = "", model: str = "") -> Path:
    (folder / "data").mkdir(parents=True, exist_ok=True)
    (folder / "data" / "chat.jsonl").write_text(
        "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    (folder / "t.jinja").write_text(TEMPLATE)
    model = model or f'tokenizer = "{tokenizer}"'
    plan = folder / "plan.toml"
    plan.write_text(f'[run]\nname = "v"\n[model]\nuse = "scratch"\n{model}\n[template]\nuse = "jinja"\n'
                    f'path = "t.jinja"\n[data.chat]\nuse = "jsonl"\npath = "data/chat.jsonl"\n{source}\n'
                    '[[stage]]\nname = "sft"\ntrainer = "sft"\ndata = "chat"\nadapter = "full"\n')
    return plan


@pytest.fixture(autouse=True)
def _in_the_plans_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # messages name the template file relative to it


def validate(capsys, plan: Path, *flags: str) -> tuple[int, list[str], list[str]]:
    """The exit code, stdout after the plan's OK line (the summary), and stderr (bad rows, warnings, notes)."""
    code = main(["validate", str(plan), *flags])
    captured = capsys.readouterr()
    out = captured.out.splitlines()
    assert out[0].startswith(f"{plan}: OK: ")
    return code, out[1:], captured.err.splitlines()


def test_each_bad_row_is_one_line_on_stderr_and_the_run_would_stop(tmp_path, capsys, tokenizer_dir):
    code, out, err = validate(capsys, project(tmp_path, tokenizer_dir, ROWS), "--data")
    assert code == 2
    assert err == [*(f"data.chat: {line}" for line in LINES), f"data.chat: {PLACEHOLDER}"]
    assert out == ["data: 9 rows read from 1 file(s) in 1 source(s); 5 bad (empty answer: 1, invalid json: 1, "
                   "missing field: 1, render error: 1, role order: 1); 5 would stop the run"]


def test_without_the_flag_no_row_is_read(tmp_path, capsys, tokenizer_dir):
    code, out, err = validate(capsys, project(tmp_path, tokenizer_dir, ROWS))
    assert (code, out, err) == (0, [], [])


def test_under_skip_every_bad_row_is_reported_and_skipped_as_a_run_would(tmp_path, capsys, tokenizer_dir):
    source = 'on_error = "skip"\nplaceholders = "error"\n'
    code, out, err = validate(capsys, project(tmp_path, tokenizer_dir, ROWS, source), "--data")
    assert code == 0  # a run counts and skips them all, the unrenderable line 6 too
    assert len(err) == 6 and all(line.endswith(" (skipped)") for line in err)
    assert err[3] == ("data.chat: data/chat.jsonl:5: 'messages[0].content' holds the template placeholder '{{name}}', "
                      "never filled in (set placeholders = \"allow\" in the source to train it as it is) (skipped)")
    assert err[4] == f"data.chat: {LINES[3]} (skipped)"
    assert out == ["data: 9 rows read from 1 file(s) in 1 source(s); 6 bad (empty answer: 1, invalid json: 1, "
                   "missing field: 1, placeholder: 1, render error: 1, role order: 1); a run skips them all"]


def test_clean_data_passes_and_a_source_with_nothing_left_fails(tmp_path, capsys, tokenizer_dir):
    code, out, err = validate(capsys, project(tmp_path, tokenizer_dir, [GOOD] * 3), "--data")
    assert (code, out, err) == (0, ["data: 3 rows read from 1 file(s) in 1 source(s); no bad rows"], [])
    code, out, err = validate(capsys, project(tmp_path, tokenizer_dir, ['{"x"', '{"y"'], 'on_error = "skip"\n'),
                              "--data")
    assert code == 2 and err == ["data.chat: data/chat.jsonl:1 (and 1 more row(s) like it): invalid JSON: Expecting "
                                 "':' delimiter (column 5) (skipped)",
                                 "data.chat: no rows left: all 2 rows would be skipped"]


def test_a_scratch_tokenizer_is_trained_as_the_run_trains_it(tmp_path, capsys):
    plan = project(tmp_path, "", [GOOD, {"messages": [u("boom"), a("ok")]}], model='tokenizer_data = ["chat"]')
    code, out, err = validate(capsys, plan, "--data")
    assert code == 2 and err[0] == f"data.chat: data/chat.jsonl:2: {LINES[3].split(': ', 1)[1]}"
    # A row of the tokenizer's data that does not load: the tokenizer is trained on the rows that do, so the bad
    # row is one line and the other rows are still rendered (the third cannot be).
    code, out, err = validate(capsys, project(tmp_path, "", [GOOD, {"messages": [u("boom"), a("")]},
                                                             {"messages": [u("boom"), a("ok")]}],
                                              model='tokenizer_data = ["chat"]'), "--data")
    assert code == 2 and err == [f"data.chat: {LINES[0]}", f"data.chat: {LINES[3].replace(':6:', ':3:')}"], err


def test_what_the_stages_trainer_refuses_is_refused_before_any_model_loads(tmp_path, capsys, tokenizer_dir):
    """Rows that convert and render can still be data a trainer refuses: plain text given to sft, a conversation
    with no answer. `validate --data` runs the stage trainer's own prepare_data (no weights), as `run` would."""
    plan = project(tmp_path, tokenizer_dir, [{"text": "Hello there."}] * 3)
    code, out, err = validate(capsys, plan, "--data")
    assert code == 2 and len(err) == 1
    assert err[0] == ("data.chat (data/chat.jsonl): trainer 'sft' (stage sft) needs chat rows (messages, Alpaca, "
                      "ShareGPT, ...) or prompt/completion rows; this data has text; for plain text use trainer = "
                      "\"pretrain\"")
    assert out == ["data: 3 rows read from 1 file(s) in 1 source(s); no bad rows; 1 other problem(s) would stop the "
                   "run"]
    code, _, err = validate(capsys, project(tmp_path, tokenizer_dir, [GOOD, {"messages": [u("Hi")]}]), "--data")
    assert code == 2 and err == ["data.chat (data/chat.jsonl), row 2: 'messages' has no assistant turn, so trainer "
                                 "'sft' has nothing to train on (roles: user); add the answer, or set "
                                 "train_on_inputs = true to train on the whole conversation"]


def test_data_no_stage_uses_is_named_and_evaluations_data_is_checked(tmp_path, capsys, tokenizer_dir):
    plan = project(tmp_path, tokenizer_dir, [GOOD] * 2)
    (tmp_path / "data" / "spare.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "data" / "held.jsonl").write_text(json.dumps({"messages": [u("Hi"), a("")]}) + "\n")
    plan.write_text(plan.read_text() + '[data.spare]\nuse = "jsonl"\npath = "data/spare.jsonl"\n'
                    '[data.held]\nuse = "jsonl"\npath = "data/held.jsonl"\n'
                    '[[evaluate]]\nname = "ppl"\nuse = "perplexity"\ndata = "held"\n')
    code, out, err = validate(capsys, plan, "--data")
    assert err[0] == "note: data.spare is not checked: no stage or evaluation uses it"
    assert err[1].startswith("data.held: data/held.jsonl:1: 'messages[1]' is an assistant turn with empty content")
    assert code == 2 and out[-1].startswith("data: 3 rows read from 2 file(s) in 2 source(s); 1 bad")


def test_rows_with_one_message_are_one_line_with_their_count_and_a_suggested_mapping(tmp_path, capsys,
                                                                                    tokenizer_dir):
    """25 rows of a format ftcore does not know, in a JSON array on one line: one line naming the first by its
    index (not ':1' for each), the count, and the columns mapping their fields suggest."""
    plan = project(tmp_path, tokenizer_dir, [GOOD])
    rows = [{"question": f"q{i}", "response_j": f"good {i}", "response_k": f"bad {i}"} for i in range(25)]
    (tmp_path / "data" / "se.json").write_text(json.dumps(rows))
    plan.write_text(plan.read_text().replace('path = "data/chat.jsonl"', 'path = "data/se.json"'))
    code, out, err = validate(capsys, plan, "--data")
    assert code == 2
    assert err == ["data.chat: data/se.json: row 1 (and 24 more row(s) like it): cannot tell the row's format from "
                   "its fields (question, response_j, response_k); they look like preference pairs: set columns = "
                   "{ prompt = \"question\", chosen = \"response_j\", rejected = \"response_k\" } in the source"]
    assert out == ["data: 25 rows read from 1 file(s) in 1 source(s); 25 bad (unknown format: 25); 25 would stop "
                   "the run"]


def test_limit_stops_reading(tmp_path, capsys, tokenizer_dir):
    rows = [GOOD] * 46 + ['{"messages": [}'] + [GOOD] * 3
    code, out, err = validate(capsys, project(tmp_path, tokenizer_dir, rows, "limit = 10\n"), "--data")
    assert (code, out, err) == (0, ["data: 10 rows read from 1 file(s) in 1 source(s); no bad rows"], [])


def test_the_stages_data_mixes_expanded():
    from types import SimpleNamespace as NS

    from ftcore_plugins.data._check import stage_data

    data = {"a": NS(options=NS()), "b": NS(options=NS()), "m": NS(options=NS(sources={"a": 1.0, "b:validation": 1.0})),
            "unused": NS(options=NS())}
    sft = NS(options=NS(train_on_inputs=True))
    plan = NS(data=data, stages=[NS(data="m", eval_data=None, trainer=sft),
                                 NS(data="a", eval_data="b:validation", trainer=NS(options=NS()))])
    assert stage_data(plan) == {"a": False, "b": False}
    plan.stages = plan.stages[:1]
    assert stage_data(plan) == {"a": True, "b": True}
