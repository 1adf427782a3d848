"""The run report: report.md, report.html and the PNG plots, from real tiny runs through the CLI.

One module-scoped run trains two stages (pre-training, then LoRA SFT with eval data), evaluates before,
between the stages and after with perplexity and the third-party ``answer_length`` evaluator (the
example plugin, pip-installed for real), and exports the adapter. A second run fails in its after
evaluation. Every check reads what the report wrote and compares it with the run's own files.
"""

from __future__ import annotations

import base64
import html
import json
import os
import re
import shutil
import subprocess
import sys
import types
from html.parser import HTMLParser
from pathlib import Path

import pytest

from conftest import ROOT, TINY_HEADER, chat_rows, installed, run_cli, text_rows, write_jsonl

pytestmark = pytest.mark.slow

EXAMPLE = ROOT / "examples" / "ftcore-example-evaluator"

STAGES = """
[[stage]]
name = "pretrain"
trainer = "pretrain"
data = "text"
adapter = "full"
max_steps = 4
batch_size = 8
max_length = 64
logging_steps = 1
save_steps = 100

[[stage]]
name = "sft"
trainer = "sft"
data = "chat"
eval_data = "chat_eval"
adapter = { use = "lora", r = 4, lora_alpha = 8 }
max_steps = 6
batch_size = 8
max_length = 64
learning_rate = 3e-3
logging_steps = 1
eval_steps = 3
save_steps = 100
"""

GOOD = STAGES + """
[[evaluate]]
use = "perplexity"
data = "chat_eval"
when = ["before", "pretrain", "after"]

[[evaluate]]
use = "answer_length"          # third-party: examples/ftcore-example-evaluator
data = "chat_eval"
max_new_tokens = 4
limit = 8

[[export]]
use = "adapter"
"""

# Fails in the after evaluation: answer_length needs chat rows, and "text" has none.
BROKEN = """
[[stage]]
name = "sft"
trainer = "sft"
data = "chat"
max_steps = 3
batch_size = 8
max_length = 64
logging_steps = 1
save_steps = 100

[[evaluate]]
use = "perplexity"
data = "chat_eval"
when = "before"

[[evaluate]]
use = "answer_length"
data = "text"
when = "after"
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    project = tmp_path_factory.mktemp("report")
    write_jsonl(project / "text.jsonl", text_rows(64))
    write_jsonl(project / "chat.jsonl", chat_rows(64))
    write_jsonl(project / "chat_eval.jsonl", chat_rows(16, seed=1))
    (project / "good.toml").write_text(TINY_HEADER.replace('name = "tiny"', 'name = "good"') + GOOD)
    (project / "broken.toml").write_text(TINY_HEADER.replace('name = "tiny"', 'name = "broken"') + BROKEN)
    with installed(EXAMPLE, "ftcore-example-evaluator", tmp_path_factory.mktemp("install")):
        good = run_cli("run", str(project / "good.toml"))
        broken = run_cli("run", str(project / "broken.toml"))
    assert good.returncode == 0, good.stdout + good.stderr
    return types.SimpleNamespace(dir=project / "runs" / "good", result=good,
                                 broken_dir=project / "runs" / "broken", broken=broken)


# -- reading the report back -----------------------------------------------------------------------------

def md_table(text: str, title: str) -> list[list[str]]:
    """The rows (header first) of the markdown table under ``## title``."""
    section = text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    rows = [[c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines]
    return [rows[0], *rows[2:]]  # without the --- line


class Tables(HTMLParser):
    """Every <table> as rows of cell texts, under the <h2> before it."""

    def __init__(self):
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self.images: list[str] = []
        self._h2 = self._cell = None
        self._title = ""

    def handle_starttag(self, tag, attrs):
        if tag == "h2":
            self._h2 = ""
        elif tag == "table":
            self.tables[self._title] = []
        elif tag == "tr":
            self.tables[self._title].append([])
        elif tag in ("td", "th"):
            self._cell = ""
        elif tag == "img":
            self.images.append(dict(attrs)["src"])

    def handle_endtag(self, tag):
        if tag == "h2":
            self._title, self._h2 = self._h2, None
        elif tag in ("td", "th"):
            self.tables[self._title][-1].append(self._cell)
            self._cell = None

    def handle_data(self, data):
        if self._h2 is not None:
            self._h2 += data
        if self._cell is not None:
            self._cell += data


def html_tables(path: Path) -> Tables:
    parser = Tables()
    parser.feed(path.read_text(encoding="utf-8"))
    return parser


def close(cell: str, value) -> bool:
    """A report cell shows 4 significant digits."""
    if isinstance(value, int):
        return cell == str(value)
    return abs(float(cell) - value) <= 5e-4 * abs(value) + 1e-12


def folder_bytes(path: Path) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


# -- the tests ---------------------------------------------------------------------------------------------

def test_every_run_writes_its_report_and_prints_the_path(runs):
    html_path, md_path = runs.dir / "report.html", runs.dir / "report.md"
    assert html_path.is_file() and md_path.is_file()
    assert f"report: {html_path}" in " ".join(runs.result.stdout.split())  # rich may wrap the line
    md = md_path.read_text()
    for name in ("loss", "learning_rate", "grad_norm", "memory"):
        assert f"](report/{name}.png)" in md


def test_plots_are_real_pngs_of_the_planned_size(runs):
    from matplotlib.image import imread
    from PIL import Image

    for name in ("loss", "learning_rate", "grad_norm", "memory"):
        path = runs.dir / "report" / f"{name}.png"
        with Image.open(path) as img:
            img.verify()
        with Image.open(path) as img:
            width, height = img.size
            colours = img.convert("RGB").getcolors(maxcolors=1 << 20)
        assert width == 1000, (name, img.size)
        assert len(colours) > 20, name  # drawn lines and text, not a blank canvas
        assert imread(path).shape[:2] == (height, width)
    with Image.open(runs.dir / "report" / "loss.png") as img:  # two stages: one row of two panels
        assert img.size == (1000, 320)


def test_loss_plot_holds_every_logged_train_and_eval_loss(runs):
    from ftcore_plugins.commands.report import LINE_PLOTS, read_run, series

    expected: dict = {}
    for line in (runs.dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for key in ("loss", "eval_loss"):
            if key in record and record["stage"] in ("pretrain", "sft"):
                expected.setdefault(record["stage"], {}).setdefault(key, []).append((record["step"], record[key]))
    assert set(expected["sft"]) == {"loss", "eval_loss"} and len(expected["sft"]["eval_loss"]) == 2
    plotted = series(read_run(runs.dir), LINE_PLOTS["loss"][2])
    assert {stage: {k: list(zip(*v)) for k, v in keys.items()} for stage, keys in plotted.items()} == expected


def test_evaluation_table_equals_the_stored_evaluations_in_run_order(runs):
    phases = ["before", "pretrain", "after"]
    stored = {p: json.loads((runs.dir / "evaluations" / f"{p}.json").read_text()) for p in phases}
    md = md_table((runs.dir / "report.md").read_text(), "Evaluations")
    page = html_tables(runs.dir / "report.html").tables["Evaluations"]
    assert md[0] == page[0] == ["evaluation", "metric", *phases, "change"]
    assert md[1:] == page[1:]
    shown = {(row[0], row[1]): row[2:] for row in md[1:]}
    expected = {(ev, metric) for results in stored.values() for ev, values in results.items() for metric in values}
    assert set(shown) == expected
    for (ev, metric), cells in shown.items():
        values = [stored[p].get(ev, {}).get(metric) for p in phases]
        for cell, value in zip(cells, values):
            assert cell == "" if value is None else close(cell, value), (ev, metric, cell, value)
        numbers = [v for v in values if v is not None]
        if all(isinstance(v, int) for v in numbers):  # a count (n, tokens): how much was scored, no change
            assert cells[-1] == "", (ev, metric, cells[-1])
            continue
        change = numbers[-1] - numbers[0]
        assert abs(float(cells[-1]) - change) <= 5e-4 * abs(change), (ev, metric, cells[-1])
    assert any(cells[-1] == "" for cells in shown.values()) and any(cells[-1] for cells in shown.values())


def test_third_party_evaluator_is_in_the_report_tables_and_metrics(runs):
    after = json.loads((runs.dir / "evaluations" / "after.json").read_text())["answer_length"]
    assert {"mean_tokens", "stop_rate", "n"} <= set(after)
    for table in (md_table((runs.dir / "report.md").read_text(), "Evaluations"),
                  html_tables(runs.dir / "report.html").tables["Evaluations"]):
        rows = {row[1]: row for row in table if row[0] == "answer_length"}
        assert set(rows) == set(after)
        for metric, value in after.items():
            assert close(rows[metric][4], value)  # the "after" column
    logged = [json.loads(line) for line in (runs.dir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in logged if r["stage"] == "evaluate:after" and "answer_length/n" in r]
    assert len(records) == 1 and records[0]["answer_length/stop_rate"] == after["stop_rate"]


def test_artifact_sizes_equal_the_real_folder_sizes(runs):
    exports = json.loads((runs.dir / "exports.json").read_text())
    rows = md_table((runs.dir / "report.md").read_text(), "Artifacts")[1:]
    assert rows == html_tables(runs.dir / "report.html").tables["Artifacts"][1:]
    sizes = {(kind, name): int(re.search(r"([\d,]+) bytes\)?$", size).group(1).replace(",", ""))
             for kind, name, _, size in rows}
    assert exports == {"adapter": "exports/adapter"}  # relative to the run folder, which may move
    expected = {("export", "adapter"): folder_bytes(runs.dir / exports["adapter"])}
    expected |= {("stage output", s): folder_bytes(runs.dir / "stages" / s / "output") for s in ("pretrain", "sft")}
    assert sizes == expected and all(v > 0 for v in expected.values())


def test_a_moved_run_reports_its_own_files(runs, tmp_path):
    from ftcore_plugins.commands.report import artifacts, read_run

    moved = tmp_path / "elsewhere"
    shutil.copytree(runs.dir, moved)
    found = {(a["kind"], a["name"]): (a["path"], a["bytes"]) for a in artifacts(read_run(moved))}
    assert found[("export", "adapter")] == (moved / "exports" / "adapter",
                                            folder_bytes(runs.dir / "exports" / "adapter"))


def test_a_file_export_counts_the_files_that_belong_to_it(tmp_path):
    from ftcore_plugins.commands.report import path_size

    (tmp_path / "model.onnx").write_bytes(b"x" * 10)
    (tmp_path / "model.onnx.data").write_bytes(b"x" * 1000)  # ONNX's external weights
    (tmp_path / "model.onnx_other").write_bytes(b"x" * 7)  # not one of them
    assert path_size(tmp_path / "model.onnx") == 1010


def test_time_per_step_and_run_facts_come_from_the_run_files(runs):
    summary = json.loads((runs.dir / "summary.json").read_text())
    manifest = json.loads((runs.dir / "manifest.json").read_text())
    rows = md_table((runs.dir / "report.md").read_text(), "Time per step")[1:]
    assert [(r[0], r[1]) for r in rows] == [(s["name"], f"{s['seconds']:.1f}") for s in summary["steps"]]
    facts = dict(html_tables(runs.dir / "report.html").tables["Run"])
    assert facts["status"] == "complete" and facts["plan fingerprint"] == manifest["plan_fingerprint"]
    assert facts["started"] == manifest["started_at"] and facts["ftcore version"] == manifest["ftcore_version"]
    data = md_table((runs.dir / "report.md").read_text(), "Data sources")
    assert data[0][1:] == ["text", "chat", "chat_eval"]
    assert dict((r[0], r[1:]) for r in data[1:])["rows"] == ["64", "64", "16"]


def test_html_is_self_contained_and_escapes_what_it_shows(runs, tmp_path):
    from ftcore_plugins.commands.report import write_report

    page = html_tables(runs.dir / "report.html")
    assert len(page.images) == 4
    pngs = {(runs.dir / "report" / f"{n}.png").read_bytes() for n in ("loss", "learning_rate", "grad_norm", "memory")}
    assert {base64.b64decode(src.removeprefix("data:image/png;base64,")) for src in page.images} == pngs
    assert "report/" not in (runs.dir / "report.html").read_text()  # no link to a file next to it

    copy = tmp_path / "run"
    shutil.copytree(runs.dir, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["status"], manifest["error"] = "failed", "bad <script>alert(1)</script> & a | pipe"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    html_path, md_path = write_report(copy)
    text = html_path.read_text()
    assert "<script>" not in text and html.escape(manifest["error"]) in text
    assert dict(html_tables(html_path).tables["Run"])["error"] == manifest["error"]
    assert dict(md_table(md_path.read_text(), "Run")[1:])["error"] == manifest["error"]


def test_report_command_regenerates_the_report_without_torch(runs):
    run = runs.dir  # in place: exports.json names the export folders of this very run
    md, pngs = (run / "report.md").read_text(), sorted(p.name for p in (run / "report").iterdir())
    for name in ("report.md", "report.html"):
        (run / name).unlink()
    shutil.rmtree(run / "report")
    code = ("import json, sys\nfrom ftcore.cli import main\ncode = main(sys.argv[1:])\n"
            "print(json.dumps({'code': code, 'heavy': sorted(m for m in ('torch', 'transformers') "
            "if m in sys.modules)}))")
    result = subprocess.run([sys.executable, "-c", code, "report", str(run)], capture_output=True, text=True,
                            timeout=3600, cwd=ROOT)
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out == {"code": 0, "heavy": []}, result.stderr
    assert f"wrote {run / 'report.html'} and {run / 'report.md'}" in result.stdout
    assert (run / "report.md").read_text() == md and (run / "report.html").is_file()
    assert sorted(p.name for p in (run / "report").iterdir()) == pngs


def test_report_command_refuses_a_missing_or_non_run_folder(tmp_path):
    missing = run_cli("report", str(tmp_path / "nope"))
    assert missing.returncode == 2
    assert missing.stderr.strip() == f"error: {tmp_path / 'nope'}: no such run directory"
    (tmp_path / "notes.txt").write_text("mine")
    other = run_cli("report", str(tmp_path))
    assert other.returncode == 2
    assert other.stderr.strip() == f"error: {tmp_path}: not an ftcore run (no readable manifest.json)"
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]  # nothing written into a folder that is not a run


def test_a_failed_run_gets_a_report_from_what_it_left(runs):
    run = runs.broken_dir
    assert runs.broken.returncode == 2, runs.broken.stdout + runs.broken.stderr
    assert "needs chat data" in runs.broken.stderr
    assert not (run / "summary.json").exists()
    assert f"report: {run / 'report.html'}" in " ".join(runs.broken.stdout.split())
    md = (run / "report.md").read_text()
    facts = dict(md_table(md, "Run")[1:])
    assert facts["status"] == "failed" and "needs chat data" in facts["error"]
    marker = json.loads((run / "stages" / "sft" / "COMPLETE.json").read_text())
    assert md_table(md, "Time per step")[1:] == [["sft", f"{marker['seconds']:.1f}", "100%",
                                                   f"train_loss={marker['metrics']['train_loss']:.4g}, "
                                                   f"global_step={marker['metrics']['global_step']}, "
                                                   f"train_tokens={marker['metrics']['train_tokens']}, "
                                                   f"tokens_per_second={marker['metrics']['tokens_per_second']:.4g}"]]
    assert "_completed stages only (the run has no summary.json)_" in md
    assert md_table(md, "Evaluations")[0] == ["evaluation", "metric", "before"]
    assert (run / "report" / "loss.png").is_file()


def test_a_report_that_fails_is_a_warning_not_the_runs_error(runs, tmp_path, capsys):
    from rich.console import Console

    from ftcore.reporter import Reporter
    from ftcore_plugins.commands import report

    copy = tmp_path / "run"
    shutil.copytree(runs.dir, copy)
    (copy / "report.html").unlink()
    (copy / "report.html").mkdir()  # the report cannot replace a folder
    (copy / "report.html" / "keep").write_text("a user's file")
    console = Console(record=True, width=200)
    report.ftcore_run_end(types.SimpleNamespace(is_main=True, run_dir=copy, reporter=Reporter(console, None, None, None)),
                          error=None)
    assert "warning: could not write the run report: IsADirectoryError" in capsys.readouterr().err  # not stdout
    assert (copy / "report.html" / "keep").read_text() == "a user's file"
