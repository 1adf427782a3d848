"""The run report: ``report.md`` and ``report.html`` with PNG plots, built only from a run directory's files.

Everything here reads what a run wrote (``manifest.json``, ``metrics.jsonl``, ``evaluations/*.json``,
``data_report.json``, ``exports.json``, ``stages/*/COMPLETE.json``, ``summary.json`` when the run got that
far), so ``ftcore report <run dir>`` works after the fact and on a run that failed halfway. The report
knows no evaluator, trainer or exporter by name: whatever a plugin logged shows up. matplotlib is imported
only when plots are drawn.
"""

from __future__ import annotations

import argparse
import base64
import html
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ftcore
from ftcore import rundir
from ftcore.command import Command
from ftcore.errors import FtcoreError
from ftcore.plan import phase_order
from ftcore.reporter import format_value
from ftcore_plugins.commands._summary import evaluation_rows, print_summary

PLOT_DIR = "report"
PLOT_WIDTH_IN, PANEL_HEIGHT_IN, PLOT_DPI = 10.0, 3.2, 100  # every PNG is 1000 px wide
PANELS_PER_ROW = 3
# Which logged keys go into which line plot; trainers name the learning rate differently (TRL vs PPO).
LINE_PLOTS = {
    "loss": ("Loss per stage", "loss", lambda k: k in ("loss", "eval_loss") or k.startswith("loss/")),
    "learning_rate": ("Learning rate per stage", "learning rate", lambda k: k in ("learning_rate", "lr")),
    "grad_norm": ("Gradient norm per stage", "gradient norm", lambda k: k == "grad_norm"),
}
MEMORY_COLUMNS = {"rss_mib": "RSS", "peak_rss_mib": "peak RSS", "cuda_allocated_mib": "CUDA allocated",
                  "cuda_reserved_mib": "CUDA reserved", "cuda_peak_allocated_mib": "CUDA peak"}
STAGE_RESULTS = ("train_loss", "global_step", "train_tokens", "tokens_per_second")


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[Any]]
    note: str = ""


@dataclass
class Plot:
    name: str  # file stem under report/
    title: str
    path: Path


@dataclass
class RunFiles:
    """What a run directory holds, read once."""

    run_dir: Path
    manifest: dict[str, Any]
    summary: dict[str, Any] | None
    records: list[dict[str, Any]]
    evaluations: dict[str, dict[str, Any]]  # phase -> evaluation -> metric -> value, in run order
    data_report: dict[str, Any]
    exports: dict[str, str]
    markers: dict[str, dict[str, Any]] = field(default_factory=dict)  # stage -> COMPLETE.json


def read_run(run_dir: Path | str) -> RunFiles:
    run_dir = Path(run_dir).expanduser().resolve()
    if not run_dir.is_dir():
        raise FtcoreError(f"{run_dir}: no such run directory")
    manifest = rundir.read_json(run_dir / rundir.MANIFEST)
    if not isinstance(manifest, dict):
        raise FtcoreError(f"{run_dir}: not an ftcore run (no readable {rundir.MANIFEST})")
    stages = [s["name"] for s in manifest.get("resolved", {}).get("stages", [])]
    markers = {name: m for name in stages if (m := rundir.read_json(run_dir / "stages" / name / rundir.COMPLETE))}
    return RunFiles(run_dir, manifest, rundir.read_json(run_dir / "summary.json"), read_records(run_dir),
                    _evaluations(run_dir, stages), rundir.read_json(run_dir / "data_report.json") or {},
                    rundir.read_json(run_dir / "exports.json") or {}, markers)


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    """The run's metric records; of a step that a resumed run redid, only the last attempt's."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:  # a run killed mid-write leaves half a line
            continue
    return latest_attempts(records)


def latest_attempts(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``records`` without those of a training step that a later attempt (``--resume``) logged again.
    Records without ``attempt`` (written before ftcore recorded it) are all kept, as they were."""
    last: dict[tuple[Any, Any], int] = {}
    for i, r in enumerate(records):
        if r.get("step") is not None:
            key = (r.get("stage"), r["step"])
            if r.get("attempt", 1) >= records[last[key]].get("attempt", 1) if key in last else True:
                last[key] = i
    keep_attempt = {key: records[i].get("attempt", 1) for key, i in last.items()}
    out = []
    for r in records:
        key = (r.get("stage"), r.get("step"))
        if r.get("step") is None or r.get("attempt", 1) == keep_attempt[key]:
            out.append(r)
    return out


def _evaluations(run_dir: Path, stages: list[str]) -> dict[str, dict[str, Any]]:
    """Phases in run order: before, the stages in plan order, after, then any other stored phase."""
    folder = run_dir / "evaluations"
    stored = sorted(p.stem for p in folder.glob("*.json")) if folder.is_dir() else []
    known = phase_order(stages)
    order = [p for p in known if p in stored] + [p for p in stored if p not in known]
    return {phase: rundir.read_json(folder / f"{phase}.json") or {} for phase in order}


# -- tables ----------------------------------------------------------------------------------------------

def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def facts_table(run: RunFiles) -> Table:
    m = run.manifest
    hw = m.get("hardware") or {}
    hardware = ", ".join(filter(None, [hw.get("platform"), f"{hw['cpu_count']} CPUs" if "cpu_count" in hw else "",
                                       f"{hw['memory_gib']} GiB memory" if "memory_gib" in hw else "",
                                       "GPUs: " + ", ".join(hw["gpus"]) if hw.get("gpus") else ""]))
    git = m.get("git") or {}
    rows = [["plan", (m.get("plan") or {}).get("run", {}).get("name", run.run_dir.name)],
            ["plan file", m.get("plan_path")], ["status", m.get("status")], ["error", m.get("error")],
            ["plan fingerprint", m.get("plan_fingerprint")], ["started", m.get("started_at")],
            ["ended", m.get("ended_at")], ["resumed", ", ".join(m.get("resumed_at", []))],
            ["ftcore version", m.get("ftcore_version")], ["hardware", hardware],
            ["processes", m.get("world_size")],
            ["git", f"{git['sha']}{' (dirty)' if git.get('dirty') else ''}" if git.get("sha") else None]]
    return Table("Run", ["", ""], [r for r in rows if r[1] not in (None, "")])


def evaluation_table(run: RunFiles) -> Table | None:
    """Every evaluation and metric, built-in or from a plugin: one column per phase, and the change."""
    columns, rows = evaluation_rows(run.evaluations)
    if not rows:
        return None
    phases = len(columns) - 3  # besides evaluation, metric and change
    note = "change: the last phase with a value minus the first" if phases > 2 else ""
    return Table("Evaluations", columns, rows, note)


def stage_table(run: RunFiles) -> Table | None:
    """Time per step (from summary.json; without it, from the stages' COMPLETE.json markers)."""
    if run.summary and run.summary.get("steps"):
        steps = [(s["name"], None if s.get("skipped") else s.get("seconds")) for s in run.summary["steps"]]
        results = run.summary.get("stages", {})
        note = ""
    else:
        steps = [(name, marker.get("seconds")) for name, marker in run.markers.items()]
        results = {name: marker.get("metrics", {}) for name, marker in run.markers.items()}
        note = "completed stages only (the run has no summary.json)"
    if not steps:
        return None
    total = sum(s for _, s in steps if s)
    rows = []
    for name, seconds in steps:
        shown = ", ".join(f"{k}={format_value(v)}" for k, v in results.get(name, {}).items() if k in STAGE_RESULTS)
        time = "skipped (done)" if seconds is None else f"{seconds:.1f}"
        share = f"{100 * seconds / total:.0f}%" if seconds is not None and total else ""
        rows.append([name, time, share, shown])
    return Table("Time per step", ["step", "seconds", "share", "result"], rows, note)


def data_tables(run: RunFiles) -> list[Table]:
    """data_report.json, transposed (one column per entry): sources, then the data each stage prepared."""
    groups: dict[str, dict[str, Any]] = {}
    for name, values in run.data_report.items():
        title = "Data sources" if name.startswith("source/") else "Data prepared for training"
        groups.setdefault(title, {})[name.removeprefix("source/")] = values
    tables = []
    for title, entries in groups.items():
        keys = dict.fromkeys(k for values in entries.values() for k in values)
        rows = [[key, *(_cell(values.get(key)) for values in entries.values())] for key in keys]
        tables.append(Table(title, ["", *entries], rows))
    return tables


def _cell(v: Any) -> Any:
    """A data report value for one cell: nested values as text, numbers as they are."""
    if isinstance(v, dict):
        return ", ".join(f"{k}: {format_value(_cell(x))}" for k, x in v.items()) or "none"
    if isinstance(v, list):
        return ", ".join(str(x.get("path", x)) if isinstance(x, dict) else format_value(_cell(x)) for x in v)
    return v


def artifacts(run: RunFiles) -> list[dict[str, Any]]:
    """Exports and stage outputs with their sizes in bytes (a folder counts every file under it)."""
    found = [{"kind": "export", "name": name, "path": rundir.stored(run.run_dir, path)}
             for name, path in run.exports.items()]
    found += [{"kind": "stage output", "name": name, "path": run.run_dir / "stages" / name / "output"}
              for name in run.markers]
    for item in found:
        item["bytes"] = path_size(item["path"])
    return found


def path_size(path: Path) -> int | None:
    if path.is_file():  # with the files that belong to it: ONNX's external weights, model.onnx.data
        return sum(p.stat().st_size for p in path.parent.glob(f"{path.name}*")
                   if p.is_file() and (p == path or p.name.startswith(path.name + ".")))
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())
    return None


def human_size(n: int | None) -> str:
    if n is None:
        return "missing"
    size, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{size:.1f} {unit} ({n:,} bytes)" if unit != "B" else f"{n:,} bytes"


def artifact_table(run: RunFiles) -> Table | None:
    rows = []
    for item in artifacts(run):
        path = item["path"]
        shown = path.relative_to(run.run_dir) if path.is_relative_to(run.run_dir) else path
        rows.append([item["kind"], item["name"], str(shown), human_size(item["bytes"])])
    return Table("Artifacts", ["kind", "name", "path", "size"], rows) if rows else None


def memory_points(run: RunFiles) -> dict[str, dict[str, float]]:
    """Measured memory by point of the run (``memory`` records: ``<point>/<metric>`` keys), in MiB."""
    points: dict[str, dict[str, float]] = {}
    for record in run.records:
        if record.get("stage") != "memory":
            continue
        for key, value in record.items():
            point, _, metric = key.rpartition("/")
            if point and metric in MEMORY_COLUMNS and _number(value):
                points.setdefault(point, {})[metric] = value
    return points


def tables(run: RunFiles) -> tuple[list[Table], list[Table]]:
    """The tables that go before the plots (run facts, evaluations) and those after them."""
    head = [facts_table(run), evaluation_table(run)]
    tail = [stage_table(run), *data_tables(run), artifact_table(run)]
    return [t for t in head if t is not None], [t for t in tail if t is not None]


# -- plots -----------------------------------------------------------------------------------------------

def series(run: RunFiles, wanted) -> dict[str, dict[str, tuple[list[int], list[float]]]]:
    """stage -> key -> (steps, values) for the training records whose keys ``wanted`` accepts."""
    out: dict[str, dict[str, tuple[list[int], list[float]]]] = {}
    for record in run.records:
        stage, step = record.get("stage"), record.get("step")
        if stage == "memory" or str(stage).startswith("evaluate:") or not isinstance(step, int):
            continue
        for key, value in record.items():
            if key not in ("time", "stage", "step", "attempt") and wanted(key) and _number(value):
                steps, values = out.setdefault(stage, {}).setdefault(key, ([], []))
                steps.append(step)
                values.append(value)
    return out


def make_plots(run: RunFiles) -> list[Plot]:
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    folder = run.run_dir / PLOT_DIR
    folder.mkdir(exist_ok=True)
    plots = []
    for name, (title, ylabel, wanted) in LINE_PLOTS.items():
        data = series(run, wanted)
        if data:
            fig = _line_panels(plt, data, title, ylabel)
            plots.append(_save(plt, fig, Plot(name, title, folder / f"{name}.png")))
    points = memory_points(run)
    if points:
        plots.append(_save(plt, _memory_bars(plt, points), Plot("memory", "Memory per point of the run",
                                                                folder / "memory.png")))
    made = {p.path.name for p in plots}
    for stale in (*LINE_PLOTS, "memory"):  # a regenerated report drops plots that no longer have data
        if f"{stale}.png" not in made:
            (folder / f"{stale}.png").unlink(missing_ok=True)
    return plots


def _line_panels(plt, data, title: str, ylabel: str):
    """One panel per stage (steps restart at each stage), one line per key."""
    cols = min(len(data), PANELS_PER_ROW)
    rows = -(-len(data) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(PLOT_WIDTH_IN, PANEL_HEIGHT_IN * rows), dpi=PLOT_DPI,
                             squeeze=False, layout="constrained")
    for ax, (stage, lines) in zip(axes.flat, data.items()):
        for key, (steps, values) in lines.items():
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=key,
                    linestyle="--" if key.startswith("eval") else "-")
        ax.set_title(f"stage {stage}")
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if len(lines) > 1 or ylabel == "loss":
            ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(data):]:
        ax.set_visible(False)
    fig.suptitle(title)
    return fig


def _memory_bars(plt, points: dict[str, dict[str, float]]):
    """Grouped horizontal bars: one group per measurement point, one bar per memory metric present."""
    metrics = [m for m in MEMORY_COLUMNS if any(m in v for v in points.values())]
    height = 0.8 / len(metrics)
    fig, ax = plt.subplots(figsize=(PLOT_WIDTH_IN, max(PANEL_HEIGHT_IN, 0.25 * len(points) * len(metrics) + 1)),
                           dpi=PLOT_DPI, layout="constrained")
    labels = list(points)
    for i, metric in enumerate(metrics):
        ys = [n + i * height for n in range(len(labels))]
        ax.barh(ys, [points[p].get(metric, 0) for p in labels], height=height, label=MEMORY_COLUMNS[metric])
    ax.set_yticks([n + height * (len(metrics) - 1) / 2 for n in range(len(labels))], labels)
    ax.invert_yaxis()  # run order from the top
    ax.set_xlabel("MiB (measured)")
    ax.set_title("Memory per point of the run")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize="small")
    return fig


def _save(plt, fig, plot: Plot) -> Plot:
    fig.savefig(plot.path, dpi=PLOT_DPI)
    plt.close(fig)
    return plot


# -- rendering -------------------------------------------------------------------------------------------

def render_markdown(head: list[Table], tail: list[Table], plots: list[Plot], title: str | None = None) -> str:
    def cell(v: Any) -> str:
        return format_value(v).replace("|", "\\|").replace("\n", " ")

    def table(t: Table) -> list[str]:
        out = [f"## {t.title}", ""] + ([f"_{t.note}_", ""] if t.note else [])
        out.append("| " + " | ".join(cell(c) for c in t.columns) + " |")
        out.append("|" + "|".join(" --- " for _ in t.columns) + "|")
        return out + ["| " + " | ".join(cell(v) for v in row) + " |" for row in t.rows] + [""]

    out = [f"# {cell(title or 'Run report: ' + format_value(head[0].rows[0][1]))}", ""]
    for t in head:
        out += table(t)
    if plots:
        out += ["## Plots", ""] + [f"![{p.title}]({PLOT_DIR}/{p.path.name})\n" for p in plots]
    for t in tail:
        out += table(t)
    return "\n".join(out)


CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; color: #222; max-width: 1040px;
       margin: 2em auto; padding: 0 1em; line-height: 1.4; }
h1 { font-size: 1.6em; border-bottom: 2px solid #ddd; padding-bottom: .3em; }
h2 { font-size: 1.2em; margin-top: 1.8em; }
.scroll { overflow-x: auto; }
table { border-collapse: collapse; font-size: .9em; margin: .5em 0; }
th, td { border: 1px solid #ddd; padding: .3em .7em; text-align: left; vertical-align: top;
         overflow-wrap: anywhere; }
th { background: #f4f4f4; }
td:first-child { white-space: nowrap; overflow-wrap: normal; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
tr:nth-child(even) td { background: #fafafa; }
.note { color: #666; font-size: .85em; }
.status-complete { color: #1a7f37; font-weight: bold; }
.status-failed, .status-interrupted, .status-running { color: #cf222e; font-weight: bold; }
img { max-width: 100%; border: 1px solid #eee; margin: .5em 0; }
"""


def _numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def render_html(head: list[Table], tail: list[Table], plots: list[Plot], title: str | None = None) -> str:
    e = html.escape

    def table(t: Table) -> list[str]:
        out = [f"<h2>{e(t.title)}</h2>"] + ([f'<p class="note">{e(t.note)}</p>'] if t.note else [])
        out.append('<div class="scroll"><table>')
        if any(t.columns):  # a key/value table has no header, and its values stay left-aligned
            out.append("<tr>" + "".join(f"<th>{e(str(c))}</th>" for c in t.columns) + "</tr>")
        for row in t.rows:
            cells = []
            for i, v in enumerate(row):
                text, css = format_value(v), ""
                if any(t.columns) and i > 0 and _numeric(text):
                    css = ' class="num"'
                elif not any(t.columns) and row[0] == "status" and i == 1:
                    css = f' class="status-{e(text)}"'
                cells.append(f"<td{css}>{e(text)}</td>")
            out.append("<tr>" + "".join(cells) + "</tr>")
        return out + ["</table></div>"]

    title = title or f"Run report: {format_value(head[0].rows[0][1])}"
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', f"<title>{e(title)}</title>",
           f"<style>{CSS}</style></head><body>", f"<h1>{e(title)}</h1>"]
    for t in head:
        out += table(t)
    if plots:
        out.append("<h2>Plots</h2>")
    for plot in plots:  # embedded, so the page can be mailed on its own
        data = base64.b64encode(plot.path.read_bytes()).decode("ascii")
        out.append(f'<img alt="{e(plot.title)}" src="data:image/png;base64,{data}">')
    for t in tail:
        out += table(t)
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def write_report(run_dir: Path | str) -> tuple[Path, Path]:
    """Write ``report.html``, ``report.md`` and the PNGs under ``report/`` into a run directory."""
    run = read_run(run_dir)
    (head, tail), plots = tables(run), make_plots(run)
    html_path, md_path = run.run_dir / "report.html", run.run_dir / "report.md"
    for path, text in ((md_path, render_markdown(head, tail, plots)), (html_path, render_html(head, tail, plots))):
        rundir.write_text(path, text)
    return html_path, md_path


class ReportCommand(Command):
    """Write a run's report.html and report.md again.

    Writes report.html, report.md and the plots under report/ into a run directory, from its files
    alone (a failed run's too). Every run writes its report when it ends; this rewrites it.
    """

    name = "report"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("run_dir", help="the run directory, e.g. runs/<name>")

    def run(self, args: argparse.Namespace) -> int:
        html_path, md_path = write_report(args.run_dir)
        print(f"wrote {html_path} and {md_path}")
        return 0


@ftcore.hookimpl
def register_commands(register):
    register(ReportCommand)


@ftcore.hookimpl
def ftcore_run_end(run: Any, error: BaseException | None) -> None:
    """Every run, failed ones too, ends with its report (main rank). A report that fails is a warning,
    never the run's error."""
    if not run.is_main:
        return
    try:
        html_path, _ = write_report(run.run_dir)
    except Exception as exc:  # noqa: BLE001 - the run's own result must stand
        run.reporter.warn(f"could not write the run report: {type(exc).__name__}: {exc}")
    else:
        run.reporter.info(f"report: {html_path}")


@ftcore.hookimpl
def ftcore_run_summary(console: Any, summary: dict[str, Any]) -> None:
    """``ftcore run``'s tables when a run completes: evaluations, steps, memory, artifacts."""
    print_summary(console, summary)
