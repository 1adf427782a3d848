"""Bad data: each problem is one line naming the source, the file, the line (JSON, text)
or row (CSV, Parquet) and the field; with on_error = "skip" bad rows are skipped, counted
in the source's stats and the first few shown."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_cli
from test_sources import datasets_cache, load_data  # noqa: F401  (datasets_cache: autouse fixture)

from ftcore.errors import FtcoreError, PlanError

ALPACA = {"instruction": "Name a colour.", "input": "", "output": "Red."}
CHAT = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}


def lines(*rows) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n" for r in rows)


def write(folder: Path, name: str, content: str | bytes) -> str:
    path = folder / "data" / name
    path.parent.mkdir(exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return f"data/{name}"


def error(folder: Path, section: str) -> str:
    with pytest.raises(FtcoreError) as info:
        load_data(folder, section)
    message = str(info.value)
    assert "\n" not in message, message
    assert message.startswith("data.train: "), message
    return message


def source(use: str, path: str, extra: str = "") -> str:
    return f'use = "{use}"\npath = "{path}"\n{extra}'


# -- one problem each ----------------------------------------------------------------------------------

def test_malformed_json_line(tmp_path):
    path = write(tmp_path, "x.jsonl", lines(ALPACA, ALPACA, '{"instruction": "a" "output": "b"}', ALPACA))
    assert error(tmp_path, source("json", path)) == \
        "data.train: data/x.jsonl:3: invalid JSON: Expecting ',' delimiter (column 21)"


def test_truncated_json_array(tmp_path):
    text = json.dumps([ALPACA] * 4, indent=2)
    path = write(tmp_path, "t.json", text[: text.rindex('"output"') + 5])
    msg = error(tmp_path, source("json", path))
    last_line = text[: text.rindex('"output"')].count("\n") + 1
    assert msg.startswith(f"data.train: data/t.json:{last_line}: invalid JSON: ")
    assert "is it truncated?" in msg


def test_csv_row_with_too_many_fields(tmp_path):
    path = write(tmp_path, "b.csv", "instruction,output\nName a colour.,Red.\nCount to two.,1 2\nAdd.,1,2\nx,y\n")
    assert error(tmp_path, source("csv", path)) == (
        "data.train: data/b.csv: row 3 (line 4): expected 2 fields (as in the header: instruction, output), got 3; "
        "quote values that contain commas")


def test_json_lines_not_utf8(tmp_path):
    path = write(tmp_path, "l.jsonl", lines(ALPACA, {"instruction": "Café?", "output": "Oui."}).encode("latin-1"))
    msg = error(tmp_path, source("jsonl", path))
    assert msg.startswith("data.train: data/l.jsonl:2: not UTF-8 text (invalid continuation byte: byte 0xe9 at "
                          "column 21)"), msg


def test_csv_not_utf8(tmp_path):
    path = write(tmp_path, "l.csv", "instruction,output\nA,B\nCafé?,Oui.\n".encode("cp1252"))
    assert error(tmp_path, source("csv", path)).startswith("data.train: data/l.csv:3: not UTF-8 text (")


def test_text_not_utf8(tmp_path):
    path = write(tmp_path, "t.txt", "first line\nsecond\nthird: Café\n".encode("latin-1"))
    msg = error(tmp_path, source("text", path, 'unit = "line"\n'))
    assert msg.startswith("data.train: data/t.txt:3: not UTF-8 text (")


@pytest.mark.parametrize("use, name, content", [
    ("json", "e.jsonl", ""), ("csv", "e.csv", ""), ("parquet", "e.parquet", ""), ("text", "e.txt", ""),
])
def test_empty_file(tmp_path, use, name, content):
    path = write(tmp_path, name, content)
    assert error(tmp_path, source(use, path)) == f"data.train: data/{name}: empty file"


def test_json_array_with_no_rows(tmp_path):
    path = write(tmp_path, "none.json", "[]\n")
    assert "data/none.json: no rows" in error(tmp_path, source("json", path))


def test_csv_row_missing_a_required_field(tmp_path):
    path = write(tmp_path, "q.csv", "question,answer\nA?,a\nB?,b\nC?,c\nD?,d\nE?,e\n")
    assert error(tmp_path, source("csv", path, 'format = "alpaca"\n')) == (
        "data.train: data/q.csv: row 1: missing field 'instruction' (fields: question, answer); "
        'map it with columns = { instruction = "question" }')  # a field that looks like it
    path = write(tmp_path, "q2.csv", "instruction,output\nA?,a\nB?,b\nC?,c\nD?,d\nE?,\n")
    msg = error(tmp_path, source("csv", path))
    assert msg.startswith("data.train: data/q2.csv: row 5: missing field 'output' (it is empty or null in this row; "
                          "fields: instruction)"), msg


def test_json_array_row_missing_a_field_names_its_line(tmp_path):
    rows = [ALPACA, ALPACA, {"instruction": "No answer here."}, ALPACA]
    path = write(tmp_path, "a.json", json.dumps(rows, indent=2))
    line = json.dumps(rows, indent=2).split("\n").index("  {", 0) + 1  # the first row starts on line 2
    assert line == 2
    msg = error(tmp_path, source("json", path))
    assert msg.startswith("data.train: data/a.json:12: missing field 'output'"), msg


def test_blank_lines_count_in_line_numbers(tmp_path):
    path = write(tmp_path, "gaps.jsonl", lines(CHAT, "", CHAT, "   ", {"messages": [{"role": "user"}]}))
    msg = error(tmp_path, source("json", path))
    assert msg.startswith("data.train: data/gaps.jsonl:5: missing field 'messages[0].content'"), msg


def test_wrong_type(tmp_path):
    path = write(tmp_path, "wt.jsonl", lines(CHAT, {"messages": "Hi there"}))
    assert error(tmp_path, source("json", path)) == \
        "data.train: data/wt.jsonl:2: field 'messages' must be a list of messages, got a string"


def test_unknown_role(tmp_path):
    path = write(tmp_path, "r.jsonl", lines(CHAT, CHAT, {"messages": [{"role": "user", "content": "Hi"},
                                                                       {"role": "bot", "content": "Hello"}]}))
    assert error(tmp_path, source("json", path)) == (
        "data.train: data/r.jsonl:3: unknown role 'bot' in 'messages[1].role' "
        "(expected one of: system, user, assistant, tool)")


def test_empty_conversation(tmp_path):
    turn = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}
    path = write(tmp_path, "ec.jsonl", lines(turn, {"conversations": []}))
    assert error(tmp_path, source("json", path)) == \
        "data.train: data/ec.jsonl:2: empty conversation: 'conversations' has no messages"


def test_identical_chosen_and_rejected_are_skipped_and_counted(tmp_path):
    rows = [{"prompt": "2+2?", "chosen": "4", "rejected": "5"}, {"prompt": "3+3?", "chosen": "6", "rejected": "6"},
            {"prompt": "1+1?", "chosen": "2", "rejected": "3"}]
    path = write(tmp_path, "pairs.jsonl", lines(*rows))
    got = load_data(tmp_path, source("json", path))  # on_error = "error": still loads, the pair teaches nothing
    assert len(got.ds) == 2 and got.ds["prompt"][1] == [{"role": "user", "content": "1+1?"}]
    assert got.stats["skipped"] == {"identical_chosen_rejected": 1}
    assert got.stats["rows_read"] == 3 and got.stats["rows"] == 2
    assert "data.train: data/pairs.jsonl:2: 'chosen' and 'rejected' are identical" in got.output


def test_hh_pair_with_no_shared_prefix(tmp_path):
    row = {"chosen": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
           "rejected": [{"role": "user", "content": "Hey"}, {"role": "assistant", "content": "Go away"}]}
    assert error(tmp_path, source("json", write(tmp_path, "hh.jsonl", lines(row)))).startswith(
        "data.train: data/hh.jsonl:1: 'chosen' and 'rejected' share no leading messages")


def test_kto_label_not_boolean(tmp_path):
    good = {**CHAT, "label": True}
    path = write(tmp_path, "k.jsonl", lines(good, good, {**CHAT, "label": "yes"}))
    assert error(tmp_path, source("json", path)).startswith(
        "data.train: data/k.jsonl:3: field 'label' must be a boolean (true = desirable, false = undesirable), "
        "got a string 'yes'")


def test_parquet_file_that_is_not_parquet(tmp_path):
    path = write(tmp_path, "n.parquet", "instruction,output\nA,B\n")
    assert error(tmp_path, source("parquet", path)).startswith(
        "data.train: data/n.parquet: not a Parquet file (it does not begin and end with the 'PAR1' marker)")


def test_parquet_row_missing_a_field(tmp_path):
    import pandas as pd

    pd.DataFrame({"instruction": ["a", "b", "c"], "output": ["x", None, "z"]}).to_parquet(tmp_path / "p.parquet")
    assert error(tmp_path, source("parquet", "p.parquet")).startswith(
        "data.train: p.parquet: row 2: missing field 'output'")


def test_glob_matching_nothing_is_a_validation_error(tmp_path):
    with pytest.raises(PlanError) as info:
        load_data(tmp_path, source("json", "data/*.jsonl"))
    assert info.value.problems == [f"{tmp_path / 'plan.toml'}: data.train.path: no file matches "
                                   f"'{tmp_path / 'data' / '*.jsonl'}' (got 'data/*.jsonl')"]


def test_mixed_kinds_in_one_file(tmp_path):
    path = write(tmp_path, "mx.jsonl", lines(ALPACA, ALPACA, {"text": "Just some text."}))
    assert error(tmp_path, source("json", path)).startswith(
        "data.train: data/mx.jsonl:3: a text row (text) among chat rows")
    with pytest.raises(FtcoreError, match="among chat rows"):  # skipping does not hide it
        load_data(tmp_path, source("json", path, 'on_error = "skip"\n'))


def test_columns_naming_a_field_the_file_lacks(tmp_path):
    path = write(tmp_path, "q.csv", "question,answer\nA?,a\n")
    assert error(tmp_path, source("csv", path, 'columns = { instruction = "question", output = "answr" }\n')) == (
        "data.train: data/q.csv: columns maps 'output' to 'answr', which is not a field of the file; "
        "did you mean 'answer'? (fields: question, answer)")


def test_kept_column_that_clashes_with_the_schema(tmp_path):
    path = write(tmp_path, "k.jsonl", lines({**ALPACA, "label": "spam"}, {"text": "t", "label": "ham"}))
    got = load_data(tmp_path, source("json", path, 'format = "alpaca"\nkeep = ["label"]\non_error = "skip"\n'))
    assert got.ds.column_names == ["messages", "label"] and got.ds["label"] == ["spam"]
    path = write(tmp_path, "t.jsonl", lines({"text": "t", "text2": "x"}))
    assert error(tmp_path, source("json", path, 'keep = ["text"]\n')) == (
        "data.train: keep names 'text', which is also a column of text rows; keep it under another name, "
        "or not at all")


def test_undetectable_format_suggests_columns_and_format(tmp_path):
    msg = error(tmp_path, source("csv", write(tmp_path, "q.csv", "query,reply,n\nA?,a,1\n")))
    assert msg == ("data.train: data/q.csv: row 1: cannot tell the row's format from its fields (query, reply, n); "
                   'they look like instructions and answers (Alpaca): set columns = { instruction = "query", output = '
                   '"reply" } in the source')
    msg = error(tmp_path, source("csv", write(tmp_path, "z.csv", "alpha,beta\nA?,a\n")))
    assert msg.startswith("data.train: data/z.csv: row 1: cannot tell the row's format from its fields "
                          "(alpha, beta); map them to our field names with columns = ")
    assert 'set format = "..."' in msg


def test_fields_that_look_like_a_known_format_get_the_mapping_once_with_the_count(tmp_path):
    """StackExchange-paired rows (question, response_j better than response_k): the mapping is suggested; under
    skip, the 25 rows with that one message are one warning with the count, or, when nothing is left, the error
    line alone; a JSON array on one line numbers its rows by index, not ':1' each."""
    rows = [{"question": f"q{i}", "response_j": f"good {i}", "response_k": f"bad {i}"} for i in range(25)]
    path = write(tmp_path, "se.json", json.dumps(rows))
    mapping = 'set columns = { prompt = "question", chosen = "response_j", rejected = "response_k" } in the source'
    assert error(tmp_path, source("json", path)) == (
        "data.train: data/se.json: row 1: cannot tell the row's format from its fields (question, response_j, "
        f"response_k); they look like preference pairs: {mapping}")
    assert error(tmp_path, source("json", path, 'on_error = "skip"\n')) == (
        "data.train: no rows left: all 25 rows were skipped (unknown format: 25); the first: data/se.json: row 1: "
        "cannot tell the row's format from its fields (question, response_j, response_k); they look like preference "
        f"pairs: {mapping}; `ftcore validate --data PLAN` lists them")
    # Among rows of a known format, read as one table (each row has every column, null where it has none):
    pairs = [{"prompt": "p", "chosen": "a", "rejected": "b"}] * 2
    path = write(tmp_path, "mixed.json", json.dumps(pairs + rows))
    got = load_data(tmp_path, source("json", path, 'on_error = "skip"\n'))
    warnings = [line for line in got.output.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: data.train: data/mixed.json: row 3: missing field 'prompt' (it is empty or null in "
                        "this row; fields: question, response_j, response_k); they look like preference pairs: "
                        f"{mapping} or set format = \"...\" (read as 'preference' from the fields) (skipped; 24 more "
                        "row(s) like it)",
                        "warning: data.train: skipped 25 of 27 rows (missing field: 25)"]
    assert got.stats["skipped_first"] == [w[len("warning: data.train: "):] for w in warnings[:1]]
    # Written one per line, the rows keep their line numbers.
    path = write(tmp_path, "lines.json", "[\n" + ",\n".join(json.dumps(r) for r in pairs + rows) + "\n]")
    assert error(tmp_path, source("json", path)).startswith("data.train: data/lines.json:4: missing field 'prompt'")


def test_when_every_row_is_skipped_the_error_is_the_one_line(tmp_path):
    """Identical chosen/rejected and empty text rows are skipped even under on_error = "error"; when that leaves
    nothing, no warning per row comes first: one line, with the count and the first row."""
    same = {"prompt": "p", "chosen": "a", "rejected": "a"}
    path = write(tmp_path, "same.jsonl", lines(*[same] * 6))
    plan = tmp_path / "plan.toml"
    plan.write_text(f'[run]\nname = "x"\n[model]\nuse = "scratch"\ntokenizer_data = ["train"]\n'
                    f'[data.train]\n{source("jsonl", path)}[[stage]]\nname = "s"\ntrainer = "dpo"\ndata = "train"\n'
                    'adapter = "full"\n')
    result = run_cli("run", str(plan), cwd=tmp_path, env={"HF_DATASETS_CACHE": str(tmp_path / "cache")})
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "error: data.train: no rows left: all 6 rows were skipped (identical chosen rejected: 6); the first: "
        "data/same.jsonl:1: 'chosen' and 'rejected' are identical, so the pair teaches nothing; `ftcore validate "
        "--data PLAN` lists them"]


# -- limit ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("use, name, text", [
    ("jsonl", "x.jsonl", lines(*[ALPACA] * 46, '{"instruction": "a" "output": "b"}', *[ALPACA] * 3)),
    ("json", "x.json", "[" + ",\n".join([json.dumps(ALPACA)] * 46 + ['{"instruction": "a" "output"}'] +
                                        [json.dumps(ALPACA)] * 3) + "]\n"),
    ("csv", "x.csv", "instruction,output\n" + "Name a colour.,Red.\n" * 46 + "A,b,extra\n" + "B,c\n" * 3),
    ("text", "x.txt", "a line\n" * 46 + "\udcff\n" + "a line\n" * 3),
])
@pytest.mark.parametrize("small", [True, False])
def test_limit_stops_reading_before_a_bad_row(tmp_path, monkeypatch, use, name, text, small):
    """`limit = 10` reads ten rows: the bad row at line 47 does not stop the load (it does without a limit).
    A small limit is read in Python, no further than it; a large one through datasets, which cannot read the
    file here, and then in Python, no further than it either."""
    if not small:
        for module in ("json", "csv", "text"):
            monkeypatch.setattr(f"ftcore_plugins.data.{module}.SMALL_LIMIT", 5)
    raw = text.encode("utf-8", "surrogateescape")
    path = write(tmp_path, name, raw)
    extra = 'unit = "line"\n' if use == "text" else ""
    assert ":47" in error(tmp_path, source(use, path, extra)) or "row 47" in error(tmp_path, source(use, path, extra))
    got = load_data(tmp_path, source(use, path, extra + "limit = 10\n"))
    assert len(got.ds) == 10 and got.stats["rows_read"] == 10
    # Over several files, in order: the second file is read for what the first leaves.
    first = write(tmp_path, "first." + name.split(".")[1], raw)
    got = load_data(tmp_path, f'use = "{use}"\npath = ["{first}", "{path}"]\n{extra}limit = 12\n')
    assert len(got.ds) == 12 and [f["rows_read"] for f in got.stats["files"]] == [12]


def test_limit_stops_a_plugin_file_source_reading(tmp_path):
    """A third-party FileSource's read_rows is not asked for a row past the limit."""
    from ftcore.context import DataContext, RunInfo
    from ftcore.testing import RecordingReporter
    from ftcore_plugins.data.base import BadRow, FileSource

    asked = []

    class Tabs(FileSource):
        name = "tabs"

        def read_rows(self, path):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                asked.append(n)
                fields = line.split("\t")
                yield BadRow("expected 2 fields", n) if len(fields) != 2 else \
                    (n, {"instruction": fields[0], "output": fields[1]})

    path = tmp_path / "x.tsv"
    path.write_text("q\ta\n" * 46 + "broken\n" + "q\ta\n" * 3)
    ctx = DataContext(RunInfo(None, tmp_path), RecordingReporter(), "train")
    with pytest.raises(FtcoreError, match="x.tsv:47: expected 2 fields"):
        Tabs(Tabs.Options(path=str(path))).load(ctx)
    asked.clear()
    assert len(Tabs(Tabs.Options(path=str(path), limit=10)).load(ctx)) == 10 and asked == list(range(1, 11))


# -- on_error = "skip" --------------------------------------------------------------------------------

def test_skip_counts_each_reason_and_shows_the_first_few(tmp_path):
    bad_role = {"messages": [{"role": "robot", "content": "x"}]}
    path = write(tmp_path, "mixed.jsonl", lines(
        CHAT, "{not json", CHAT, {"messages": "text"}, bad_role, CHAT, "[1, 2", bad_role, {"messages": []}, CHAT))
    with pytest.raises(FtcoreError, match=r"mixed\.jsonl:2: invalid JSON"):
        load_data(tmp_path, source("json", path))
    got = load_data(tmp_path, source("json", path, 'on_error = "skip"\n'))
    assert len(got.ds) == 4 and got.ds.to_list() == [CHAT] * 4
    assert got.stats["skipped"] == {"empty_conversation": 1, "invalid_json": 2, "unknown_role": 2, "wrong_type": 1}
    assert got.stats["rows_read"] == 10 and got.stats["rows"] == 4
    warnings = [line for line in got.output.splitlines() if line.startswith("warning:")]
    assert warnings[:3] == ["warning: data.train: data/mixed.jsonl:2: invalid JSON: Expecting property name "
                            "enclosed in double quotes (column 2) (skipped)",
                            "warning: data.train: data/mixed.jsonl:7: invalid JSON: Expecting ',' delimiter "
                            "(column 6) (skipped)",
                            "warning: data.train: data/mixed.jsonl:4: field 'messages' must be a list of messages, "
                            "got a string (skipped)"]
    assert warnings[3] == ("warning: data.train: skipped 6 of 10 rows (empty conversation: 1, invalid json: 2, "
                           "unknown role: 2, wrong type: 1)")


def test_skip_bad_csv_rows_and_non_utf8_lines(tmp_path):
    path = write(tmp_path, "b.csv", "instruction,output\nA,a\nB,b,extra\nC,c\n,d\n")
    got = load_data(tmp_path, source("csv", path, 'on_error = "skip"\n'))
    assert [m[0]["content"] for m in got.ds["messages"]] == ["A", "C"]
    assert got.stats["skipped"] == {"bad_csv_row": 1, "missing_field": 1}
    assert "data/b.csv: row 2 (line 3): expected 2 fields" in got.output
    assert "data/b.csv: row 4: missing field 'instruction'" in got.output
    path = write(tmp_path, "l.jsonl", lines(ALPACA, ALPACA).encode() + lines({"instruction": "é", "output": "x"})
                 .encode("latin-1") + lines(ALPACA).encode())
    got = load_data(tmp_path, source("json", path, 'on_error = "skip"\n'))
    assert len(got.ds) == 3 and got.stats["skipped"] == {"not_utf8": 1}
    assert "data/l.jsonl:3: not UTF-8 text" in got.output


def test_skip_everything_is_still_an_error(tmp_path):
    path = write(tmp_path, "all.jsonl", lines({"messages": "a"}, {"messages": "b"}))
    assert error(tmp_path, source("json", path, 'on_error = "skip"\n')) == (
        "data.train: no rows left: all 2 rows were skipped (wrong type: 2); the first: data/all.jsonl:1: field "
        "'messages' must be a list of messages, got a string; `ftcore validate --data PLAN` lists them")


def test_cli_prints_the_one_line(tmp_path):
    path = write(tmp_path, "x.jsonl", lines(ALPACA, '{"instruction": "a" "output": "b"}'))
    plan = tmp_path / "plan.toml"
    plan.write_text('[run]\nname = "bad"\n[model]\nuse = "scratch"\ntokenizer_data = ["train"]\n'
                    f'[data.train]\nuse = "json"\npath = "{path}"\n[[stage]]\ntrainer = "sft"\ndata = "train"\n',
                    encoding="utf-8")
    result = run_cli("run", str(plan), env={"HF_DATASETS_CACHE": str(tmp_path / "cache")}, timeout=3600)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "error: data.train: data/x.jsonl:2: invalid JSON: Expecting ',' delimiter (column 21)"]


# -- conversations that convert but would train wrongly -------------------------------------------------

def chat_row(*turns) -> dict:
    return {"messages": [t if isinstance(t, dict) else {"role": t[0], "content": t[1]} for t in turns]}


@pytest.mark.parametrize("row, message", [
    (chat_row(("user", "Hi"), ("assistant", "")),
     "'messages[1]' is an assistant turn with empty content (and no tool_calls): it would train on the end-of-turn "
     "token alone"),
    (chat_row(("assistant", "a"), ("assistant", "b"), ("user", "c")),
     "'messages[1]' is a second assistant turn in a row; merge them into one message"),
    (chat_row(("user", "Hi"), {"role": "assistant", "content": [{"type": "text", "text": "Hel"},
                                                                {"type": "text", "value": "lo"}]}),
     "'messages[1].content[1]' has 'value'; text parts need 'text'"),
    (chat_row(("user", "Hi"), {"role": "assistant", "content": "Hello", "thinking": "a", "reasoning": "b"}),
     "'messages[1]' has both 'thinking' and 'reasoning', and they differ; give the reasoning once"),
])
def test_conversation_problems_name_file_line_and_message(tmp_path, row, message):
    path = write(tmp_path, "c.jsonl", lines(CHAT, row, CHAT))
    assert error(tmp_path, source("json", path)) == f"data.train: data/c.jsonl:2: {message}"


def test_placeholders_warn_once_with_the_count_and_the_first_place(tmp_path):
    filled = chat_row(("user", "Write to {{name}}"), ("assistant", "Dear {{ name }},"))
    path = write(tmp_path, "p.jsonl", lines(CHAT, CHAT, filled, CHAT, filled))
    got = load_data(tmp_path, source("json", path))
    assert len(got.ds) == 5 and got.stats["placeholder_rows"] == 2
    assert [line for line in got.output.splitlines() if line.startswith("warning:")] == [
        "warning: data.train: 2 row(s) hold unfilled template placeholders, trained as they are (first: "
        "data/p.jsonl:3: 'messages[0].content' holds '{{name}}'); set placeholders = \"error\" to reject them or "
        "\"allow\" to silence this"]
    assert "placeholder" not in load_data(tmp_path, source("json", path, 'placeholders = "allow"\n')).output
    assert error(tmp_path, source("json", path, 'placeholders = "error"\n')) == (
        "data.train: data/p.jsonl:3: 'messages[0].content' holds the template placeholder '{{name}}', never filled "
        "in (set placeholders = \"allow\" in the source to train it as it is)")
    got = load_data(tmp_path, source("json", path, 'placeholders = "error"\non_error = "skip"\n'))
    assert len(got.ds) == 3 and got.stats["skipped"] == {"placeholder": 2}


def test_reasoning_is_kept_and_its_key_pruned_when_no_row_has_it(tmp_path):
    thinking = chat_row(("user", "2+2?"), {"role": "assistant", "content": "4", "thinking": "two twos"})
    got = load_data(tmp_path, source("json", write(tmp_path, "r.jsonl", lines(thinking, CHAT))))
    assert got.ds[0]["messages"][1] == {"role": "assistant", "content": "4", "reasoning_content": "two twos"}
    assert got.ds[1]["messages"][1]["reasoning_content"] is None
    got = load_data(tmp_path, source("json", write(tmp_path, "n.jsonl", lines(CHAT, CHAT))))
    assert got.ds.to_list() == [CHAT, CHAT]  # plain conversations stay {"role", "content"}


# -- a run refuses bad data before it loads the model ---------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("bad", ["a row", "the trainer"])
def test_a_run_refuses_bad_data_before_the_model_loads(tmp_path, bad):
    """A stage's data with an invalid JSON line, or plain text given to ``sft``: one line naming the file
    (and the line), exit 2, and the run stops before the model is built (no "scratch model" line, no
    "model loaded" record) and before any stage starts. The tokenizer is trained on other data, so
    nothing reads the stage's data before the check does."""
    from ftcore.testing import chat_rows, write_plan

    rows = [json.dumps(r) for r in chat_rows(8)]
    (tmp_path / "bad.jsonl").write_text("\n".join(rows[:2] + ['{"messages": [}'] + rows[2:]) + "\n")
    data = "bad" if bad == "a row" else "text"
    plan = write_plan(tmp_path, {"model": {"tokenizer_data": ["chat"]},
                                 "data": {"bad": {"use": "jsonl", "path": "bad.jsonl"}},
                                 "stage": [{"name": "sft", "trainer": "sft", "data": data, "adapter": "full",
                                            "max_steps": 2, "batch_size": 4, "max_length": 64}]})
    r = run_cli("run", str(plan), cwd=tmp_path)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    [line] = r.stderr.strip().splitlines()
    if bad == "a row":
        assert line.startswith("error: data.bad: bad.jsonl:3: invalid JSON: "), line
    else:
        assert line.startswith("error: ") and "text.jsonl" in line and "trainer 'sft'" in line, line
    assert "Traceback" not in r.stderr
    assert "scratch model:" not in r.stdout and "stage sft:" not in r.stdout, r.stdout
    records = (tmp_path / "runs" / "tiny" / "metrics.jsonl").read_text()
    assert "model loaded" not in records
