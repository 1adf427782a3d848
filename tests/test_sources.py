"""Data sources through a plan: every real fixture file loads into the right rows, CSV and
Parquet with other column names load through a `columns` mapping, and a CSV plan runs end
to end through the CLI."""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path

import pytest

from conftest import SHARED, run_cli

from ftcore.context import DataContext, RunInfo
from ftcore.errors import FtcoreError, PlanError
from ftcore.plan import load_plan
from ftcore.plugins import get_plugin_manager
from ftcore.reporter import Reporter

DATA = SHARED / "data"


def fixture(name: str) -> Path:
    path = DATA / name
    if not path.is_file():
        pytest.skip(f"shared fixture {path} is missing (see shared/fixtures/README.md)")
    return path


def raw(name: str) -> list[dict]:
    return json.loads(fixture(name).read_text(encoding="utf-8"))


@pytest.fixture(autouse=True, scope="module")
def datasets_cache(tmp_path_factory):
    """Keep datasets' Arrow cache out of the user's ~/.cache."""
    import datasets

    folder = tmp_path_factory.mktemp("hf_datasets_cache")
    old = datasets.config.HF_DATASETS_CACHE
    datasets.config.HF_DATASETS_CACHE = folder
    yield folder
    datasets.config.HF_DATASETS_CACHE = old


class Loaded:
    def __init__(self, ds, source, output: str):
        self.ds, self.source, self.output = ds, source, output

    @property
    def stats(self) -> dict:
        return self.source.stats


def plan_for(folder: Path, section: str, name: str = "train") -> Path:
    path = folder / "plan.toml"
    path.write_text(f'[model]\nuse = "scratch"\ntokenizer_data = ["{name}"]\n\n[data.{name}]\n{section}',
                    encoding="utf-8")
    return path


def load_data(folder: Path, section: str, name: str = "train") -> Loaded:
    """Validate a plan holding ``[data.<name>]`` and load that source, as the runner does."""
    from rich.console import Console

    plan = load_plan(plan_for(folder, section, name), get_plugin_manager(entry_points=False).registry())
    source = plan.data[name].create()
    out = io.StringIO()
    console = Console(file=out, width=400, color_system=None)
    reporter = Reporter(console, None, None, None, errors=console)  # warnings in the same output
    ds = source.load(DataContext(RunInfo(plan, plan.run_dir), reporter, name))
    return Loaded(ds, source, out.getvalue())


def u(text):
    return {"role": "user", "content": text}


def a(text):
    return {"role": "assistant", "content": text}


SHAREGPT = {"human": "user", "gpt": "assistant", "system": "system"}


# -- the real fixture files -------------------------------------------------------------------------

def test_alpaca_fixture(tmp_path):
    rows = raw("alpaca_en_demo.json")
    got = load_data(tmp_path, f'use = "json"\npath = "{fixture("alpaca_en_demo.json")}"\n')
    assert len(got.ds) == len(rows) == 999
    assert got.ds.column_names == ["messages"]
    assert got.stats["formats"] == {"alpaca": 999} and got.stats["rows_read"] == 999 and got.stats["rows"] == 999
    with_input = next(i for i, r in enumerate(rows) if r["input"])
    for i in (0, with_input, 998):
        r = rows[i]
        prompt = f"{r['instruction']}\n\n{r['input']}" if r["input"] else r["instruction"]
        assert got.ds[i]["messages"] == [u(prompt), a(r["output"])]
    assert "999 chat rows (alpaca)" in got.output


def test_glaive_toolcall_fixture(tmp_path):
    rows = raw("glaive_toolcall_en_demo.json")
    got = load_data(tmp_path, f'use = "json"\npath = "{fixture("glaive_toolcall_en_demo.json")}"\n')
    assert len(got.ds) == 300 and got.ds.column_names == ["messages", "tools"]
    i = next(i for i, r in enumerate(rows) if any(t["from"] == "function_call" for t in r["conversations"]))
    r, messages = rows[i], got.ds[i]["messages"]
    assert len(messages) == len(r["conversations"])  # each function_call follows a human turn here
    for turn, m in zip(r["conversations"], messages):
        if turn["from"] == "function_call":
            call = json.loads(turn["value"])
            assert m["role"] == "assistant" and m["content"] == ""
            assert json.loads(m["tool_calls"]) == [{"type": "function", "function": call}]
            name = call["name"]
        elif turn["from"] == "observation":
            assert m == {"role": "tool", "content": turn["value"], "tool_calls": None, "name": name}
        else:
            assert m == {"role": SHAREGPT[turn["from"]], "content": turn["value"], "tool_calls": None, "name": None}
    assert json.loads(got.ds[i]["tools"]) == json.loads(r["tools"])
    empty = [j for j, r in enumerate(rows) if r["tools"].strip() in ("", "[]")]
    assert empty and all(got.ds[j]["tools"] is None for j in empty[:5])


def test_llamafactory_v1_file_loads_with_its_untrained_turns_and_tool_call_ids(tmp_path):
    """LLaMA-Factory v1 rows through a source: Arrow keeps `weight` (loss_weight 0) and `tool_call_id`;
    a file without them has neither key (docs/data.md, "The internal schema")."""
    from test_formats import LF_ROW

    rows = [LF_ROW, {**LF_ROW, "messages": LF_ROW["messages"][:3] + [
        {"role": "user", "content": [{"type": "text", "value": "Again"}], "loss_weight": 0.0},
        {"role": "assistant", "content": [{"type": "text", "value": "Sure."}], "loss_weight": 1.0}]}]
    (tmp_path / "lf.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    got = load_data(tmp_path, 'use = "jsonl"\npath = "lf.jsonl"\n')
    assert got.stats["formats"] == {"messages": 2} and got.ds.column_names == ["messages", "tools"]
    first = got.ds[0]["messages"]
    assert [m["weight"] for m in first] == [None, None, 0, None, None, None, None]
    assert first[4]["reasoning_content"] == "A tool knows." and first[5]["name"] == "get_weather"
    (tmp_path / "ids.jsonl").write_text(json.dumps({"messages": [
        u("q"), {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "f", "arguments": {}}}]}, {"role": "tool", "content": "r", "tool_call_id": "c1"}, a("ok")]}) + "\n",
        encoding="utf-8")
    messages = load_data(tmp_path, 'use = "jsonl"\npath = "ids.jsonl"\n').ds[0]["messages"]
    assert messages[2]["tool_call_id"] == "c1" and set(messages[0]) == {"role", "content", "tool_calls", "name",
                                                                         "tool_call_id"}


def test_dpo_fixture_sharegpt_preference(tmp_path):
    rows = raw("dpo_en_demo.json")
    got = load_data(tmp_path, f'use = "json"\npath = "{fixture("dpo_en_demo.json")}"\n')
    assert len(got.ds) == 300 and got.ds.column_names == ["prompt", "chosen", "rejected"]
    assert got.stats["kind"] == "preference" and got.stats["formats"] == {"sharegpt_preference": 300}
    with_system = next(i for i, r in enumerate(rows) if r["conversations"][0]["from"] == "system")
    for i in (0, with_system):
        r, row = rows[i], got.ds[i]
        assert row["prompt"] == [{"role": SHAREGPT[t["from"]], "content": t["value"]} for t in r["conversations"]]
        assert row["chosen"] == [a(r["chosen"]["value"])] and row["rejected"] == [a(r["rejected"]["value"])]


def test_kto_fixture(tmp_path):
    rows = raw("kto_en_demo.json")
    got = load_data(tmp_path, f'use = "json"\npath = "{fixture("kto_en_demo.json")}"\n')
    assert got.ds.column_names == ["prompt", "completion", "label"]
    assert got.stats["kind"] == "unpaired_preference" and len(got.ds) == 300
    assert got.ds["label"] == [r["label"] for r in rows]
    longest = max(range(len(rows)), key=lambda i: len(rows[i]["messages"]))
    for i in (0, longest):
        msgs = [{"role": m["role"], "content": m["content"]} for m in rows[i]["messages"]]
        assert got.ds[i]["prompt"] == msgs[:-1] and got.ds[i]["completion"] == msgs[-1:]


def test_hh_fixture_implicit_prompt(tmp_path):
    r = raw("hh_rlhf_tiny.json")[0]
    got = load_data(tmp_path, f'use = "json"\npath = "{fixture("hh_rlhf_tiny.json")}"\n')
    assert got.ds.to_list() == [{"prompt": [u(r["chosen"][0]["content"])],
                                 "chosen": [a(r["chosen"][1]["content"])],
                                 "rejected": [a(r["rejected"][1]["content"])]}]
    assert got.stats["formats"] == {"implicit_preference": 1}


def test_c4_fixture_as_jsonl_and_as_text_lines(tmp_path):
    path = fixture("c4_demo.jsonl")
    lines = path.read_text(encoding="utf-8").splitlines()
    got = load_data(tmp_path, f'use = "jsonl"\npath = "{path}"\n')
    assert got.ds.column_names == ["text"] and len(got.ds) == len(lines)
    assert got.ds[7]["text"] == json.loads(lines[7])["text"]
    # the same file as plain text: one document per line, the raw JSON text
    got = load_data(tmp_path, f'use = "text"\npath = "{path}"\nunit = "line"\nlimit = 20\n')
    assert got.ds["text"] == lines[:20]
    got = load_data(tmp_path, f'use = "text"\npath = "{path}"\n')
    assert got.ds["text"] == [path.read_text(encoding="utf-8")]


def test_every_fixture_through_one_glob_fails_on_mixed_kinds(tmp_path):
    fixture("alpaca_en_demo.json")
    with pytest.raises(FtcoreError) as info:
        load_data(tmp_path, f'use = "json"\npath = "{DATA}/*_demo.json"\n')
    msg = str(info.value)
    assert "\n" not in msg and "dpo_en_demo.json: holds preference rows but" in msg
    assert "alpaca_en_demo.json holds chat rows" in msg


def test_list_of_paths_concatenates_in_order_and_limit_spans_files(tmp_path):
    alpaca, glaive = fixture("alpaca_en_demo.json"), fixture("glaive_toolcall_en_demo.json")
    got = load_data(tmp_path, f'use = "json"\npath = ["{alpaca}", "{glaive}"]\n')
    assert len(got.ds) == 1299 and got.stats["formats"] == {"alpaca": 999, "sharegpt": 300}
    assert [f["rows"] for f in got.stats["files"]] == [999, 300]
    assert got.ds[999]["messages"][0]["content"] == raw("glaive_toolcall_en_demo.json")[0]["conversations"][0]["value"]
    got = load_data(tmp_path, f'use = "json"\npath = ["{alpaca}", "{glaive}"]\nlimit = 1001\n')
    assert len(got.ds) == 1001 and [f["rows"] for f in got.stats["files"]] == [999, 2]
    assert got.source.inputs() == [alpaca.resolve(), glaive.resolve()]


# -- CSV and Parquet written here, with other column names --------------------------------------------

def alpaca_frame(n: int):
    import pandas as pd

    rows = raw("alpaca_en_demo.json")[:n]
    return rows, pd.DataFrame({"question": [r["instruction"] for r in rows], "context": [r["input"] for r in rows],
                               "answer": [r["output"] for r in rows], "topic": [f"t{i % 3}" for i in range(n)]})


ALPACA_COLUMNS = 'columns = { instruction = "question", input = "context", output = "answer" }\n'


def test_csv_alpaca_with_a_column_mapping_and_kept_column(tmp_path):
    rows, frame = alpaca_frame(60)
    frame.to_csv(tmp_path / "qa.csv", index=False)
    got = load_data(tmp_path, f'use = "csv"\npath = "qa.csv"\n{ALPACA_COLUMNS}keep = ["topic"]\n')
    assert got.ds.column_names == ["messages", "topic"] and len(got.ds) == 60
    reference = load_data(tmp_path, f'use = "json"\npath = "{fixture("alpaca_en_demo.json")}"\nlimit = 60\n')
    assert got.ds["messages"] == reference.ds["messages"]  # multi-line answers and commas survive CSV
    assert got.ds["topic"][:4] == ["t0", "t1", "t2", "t0"]
    assert any("\n" in r["output"] for r in rows)
    assert got.source.inputs() == [tmp_path / "qa.csv"]


def test_csv_preference_strings_with_a_mapping_and_a_delimiter(tmp_path):
    import pandas as pd

    rows = raw("dpo_en_demo.json")[:30]
    pd.DataFrame({"q": [r["conversations"][-1]["value"] for r in rows], "good": [r["chosen"]["value"] for r in rows],
                  "bad": [r["rejected"]["value"] for r in rows]}).to_csv(tmp_path / "pairs.tsv", sep="\t", index=False)
    got = load_data(tmp_path, 'use = "csv"\npath = "pairs.tsv"\ndelimiter = "\\t"\n'
                              'columns = { prompt = "q", chosen = "good", rejected = "bad" }\n')
    assert len(got.ds) == 30 and got.stats["formats"] == {"preference": 30}
    assert got.ds[3] == {"prompt": [u(rows[3]["conversations"][-1]["value"])],
                         "chosen": [a(rows[3]["chosen"]["value"])], "rejected": [a(rows[3]["rejected"]["value"])]}


def test_csv_kto_labels_and_numbers_stay_strings(tmp_path):
    (tmp_path / "k.csv").write_text("ask,reply,ok\n2+2?,4,true\n3+3?,7,False\n", encoding="utf-8")
    got = load_data(tmp_path, 'use = "csv"\npath = "k.csv"\ncolumns = { prompt = "ask", completion = "reply", '
                              'label = "ok" }\n')
    assert got.ds.to_list() == [{"prompt": [u("2+2?")], "completion": [a("4")], "label": True},
                                {"prompt": [u("3+3?")], "completion": [a("7")], "label": False}]


def test_parquet_alpaca_and_nested_sharegpt_preference(tmp_path):
    rows, frame = alpaca_frame(25)
    frame.to_parquet(tmp_path / "qa.parquet")
    got = load_data(tmp_path, f'use = "parquet"\npath = "qa.parquet"\n{ALPACA_COLUMNS}')
    r = rows[4]
    prompt = f"{r['instruction']}\n\n{r['input']}" if r["input"] else r["instruction"]
    assert len(got.ds) == 25 and got.ds[4]["messages"] == [u(prompt), a(r["output"])]

    import pandas as pd

    dpo = raw("dpo_en_demo.json")[:20]
    pd.DataFrame({"dialog": [r["conversations"] for r in dpo], "win": [r["chosen"] for r in dpo],
                  "lose": [r["rejected"] for r in dpo]}).to_parquet(tmp_path / "pairs.parquet")
    got = load_data(tmp_path, 'use = "parquet"\npath = "pairs.parquet"\n'
                              'columns = { conversations = "dialog", chosen = "win", rejected = "lose" }\n')
    assert len(got.ds) == 20 and got.stats["formats"] == {"sharegpt_preference": 20}
    assert got.ds[0]["prompt"] == [u(dpo[0]["conversations"][0]["value"])]
    assert got.ds[0]["rejected"] == [a(dpo[0]["rejected"]["value"])]


# -- compatibility, other sources ----------------------------------------------------------------------

def test_jsonl_keeps_its_plan_options(tmp_path):
    lines = [{"messages": [u("q"), a("a")]}, {"messages": [u("q2"), a("a2")]}, {"messages": [u("q3"), a("a3")]}]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines), encoding="utf-8")
    got = load_data(tmp_path, 'use = "jsonl"\npath = "chat.jsonl"\nformat = "messages"\nlimit = 2\n')
    assert got.ds.to_list() == lines[:2]
    (tmp_path / "a.jsonl").write_text(json.dumps({"instruction": "i", "output": "o", "text": "t"}) + "\n")
    assert load_data(tmp_path, 'use = "jsonl"\npath = "a.jsonl"\nformat = "text"\n').ds.to_list() == [{"text": "t"}]
    assert load_data(tmp_path, 'use = "jsonl"\npath = "a.jsonl"\nformat = "alpaca"\n').ds.to_list() == \
        [{"messages": [u("i"), a("o")]}]


def test_arrow_source_reads_save_to_disk_folders(tmp_path):
    import datasets

    rows = [{"messages": [u(f"q{i}"), a(f"a{i}")]} for i in range(10)]
    ds = datasets.Dataset.from_list(rows)
    ds.save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({"train": ds, "test": ds.select(range(3))}).save_to_disk(str(tmp_path / "two"))
    assert load_data(tmp_path, 'use = "arrow"\npath = "one"\n').ds.to_list() == rows
    got = load_data(tmp_path, 'use = "arrow"\npath = "two"\nsplit = "test"\n')
    assert got.ds.to_list() == rows[:3] and any(p.suffix == ".arrow" for p in got.source.inputs())
    with pytest.raises(FtcoreError, match=r"two: no split 'dev'; it has train, test"):
        load_data(tmp_path, 'use = "arrow"\npath = "two"\nsplit = "dev"\n')


def test_loading_twice_gives_the_same_rows_from_the_cache(tmp_path):
    path = fixture("glaive_toolcall_en_demo.json")
    first = load_data(tmp_path, f'use = "json"\npath = "{path}"\n')
    start = time.perf_counter()
    second = load_data(tmp_path, f'use = "json"\npath = "{path}"\nnum_proc = 2\n')
    assert second.ds.to_list() == first.ds.to_list()
    assert time.perf_counter() - start < 20


def test_path_globs_lists_and_bad_options_are_validation_errors(tmp_path):
    for i in range(3):
        (tmp_path / f"part{i}.jsonl").write_text(json.dumps({"text": f"doc {i}"}) + "\n", encoding="utf-8")
    got = load_data(tmp_path, 'use = "json"\npath = "part*.jsonl"\n')
    assert got.ds["text"] == ["doc 0", "doc 1", "doc 2"] and len(got.source.inputs()) == 3
    for section, fragment in [
        ('use = "json"\npath = "nothing-*.jsonl"\n', "data.train.path: no file matches"),
        ('use = "json"\npath = ["part0.jsonl", "gone.jsonl"]\n', "data.train.path: no such file or folder"),
        ('use = "json"\npath = "."\n', "is a folder; name its files"),
        ('use = "json"\npath = "part0.jsonl"\ncolumns = { outptu = "x" }\n', "unknown field 'outptu'; did you mean"),
        ('use = "json"\npath = "part0.jsonl"\nkeep = ["__x"]\n', "data.train.keep: '__x': names starting with"),
        ('use = "json"\npath = "part0.jsonl"\nformat = "sharegtp"\n', "data.train.format"),
        ('use = "json"\npath = "part0.jsonl"\non_error = "ignore"\n', "data.train.on_error"),
        ('use = "text"\npath = "part0.jsonl"\nunit = "paragraph"\n', "data.train.unit"),
        ('use = "json"\npath = "part0.jsonl"\nlimit = 0\n', "data.train.limit"),
    ]:
        with pytest.raises(PlanError) as info:
            load_data(tmp_path, section)
        assert len(info.value.problems) == 1 and fragment in info.value.problems[0], (fragment, info.value.problems)


HUB_PLAN = """
[model]
use = "scratch"
tokenizer_data = ["hub"]

[data.hub]
use = "hf"
path = "ftcore-tests/no-such-dataset"
split = "train"
"""


@pytest.mark.parametrize("env, fragment", [
    ({"HF_HUB_OFFLINE": "1"}, "is not in the local cache, and HF_HUB_OFFLINE=1 forbids downloading it"),
    ({"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0"}, "cannot reach http://127.0.0.1:9"),
])
def test_hub_source_without_network_fails_at_once_in_one_line(tmp_path, env, fragment):
    (tmp_path / "plan.toml").write_text(HUB_PLAN, encoding="utf-8")
    script = ("import sys\nfrom ftcore.plan import load_plan\nfrom ftcore.plugins import get_plugin_manager\n"
              "from ftcore.context import DataContext, RunInfo\nfrom ftcore.reporter import Reporter\n"
              "plan = load_plan(sys.argv[1], get_plugin_manager(entry_points=False).registry())\n"
              "try:\n    plan.data['hub'].create().load(DataContext(RunInfo(plan, plan.run_dir), "
              "Reporter(None, None, None, None), 'hub'))\nexcept Exception as exc:\n"
              "    print(type(exc).__name__ + ': ' + str(exc))\n")
    import subprocess
    import sys

    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "plan.toml")], capture_output=True,
                            text=True, timeout=60,
                            env={**{k: v for k, v in os.environ.items() if "proxy" not in k.lower()},
                                 "HF_DATASETS_CACHE": str(tmp_path / "cache"), **env})
    assert time.perf_counter() - start < 30
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, result.stdout + result.stderr
    assert lines[0].startswith("FtcoreError: data.hub: hub dataset 'ftcore-tests/no-such-dataset'")
    assert fragment in lines[0]


# -- end to end ----------------------------------------------------------------------------------------

CSV_PLAN = """
[run]
name = "csv"
seed = 7

[model]
use = "scratch"
hidden_size = 32
num_layers = 1
num_heads = 2
intermediate_size = 64
max_position_embeddings = 128
tokenizer_data = ["train"]
vocab_size = 300

[template]
use = "chatml"

[data.train]
use = "csv"
path = "data/qa.csv"
columns = { instruction = "question", output = "answer" }
keep = ["topic"]

[[stage]]
trainer = "sft"
data = "train"
max_steps = 3
batch_size = 4
max_length = 64
logging_steps = 1
save_steps = 100
"""


@pytest.mark.slow
def test_csv_plan_validates_and_runs_end_to_end(tmp_path):
    import pandas as pd

    (tmp_path / "data").mkdir()
    animals = ["cat", "dog", "bird", "fox"]
    pd.DataFrame({"question": [f"Which is an animal? {x}, stone, red" for x in animals * 8],
                  "answer": [f"the {x}" for x in animals * 8],
                  "topic": ["animals"] * 32}).to_csv(tmp_path / "data" / "qa.csv", index=False)
    (tmp_path / "plan.toml").write_text(CSV_PLAN, encoding="utf-8")
    env = {"HF_DATASETS_CACHE": str(tmp_path / "hf_cache")}
    result = run_cli("validate", str(tmp_path / "plan.toml"), env=env)
    assert result.returncode == 0, result.stderr
    result = run_cli("run", str(tmp_path / "plan.toml"), env=env)
    assert result.returncode == 0, result.stderr
    run = tmp_path / "runs" / "csv"
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    assert [Path(p).name for p in manifest["data_files"]] == ["qa.csv"]
    assert manifest["resolved"]["data"]["train"] == "ftcore:csv"
    assert "32 chat rows (alpaca)" in result.stdout + (run / "run.log").read_text()
