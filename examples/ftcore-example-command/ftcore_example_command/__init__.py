"""``ftcore runs [FOLDER]``: one line per run directory under FOLDER (default ``runs``), from the files
each run wrote: its status, when it started, the stages it completed, and its evaluations' main metric
before and after training; and the plan's ``[notes]`` (an owner, tags), a table this package owns.

It reads only JSON files, so it imports nothing heavy: ``ftcore --help`` loads every command module.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import ftcore
from ftcore.command import Command
from ftcore.component import Options, PlanSection
from ftcore.errors import FtcoreError


class Notes(Options):
    """The keys of ``[notes]``, validated as a component's options are (unknown keys are errors)."""

    owner: str | None = None
    tags: list[str] = []


class NotesSection(PlanSection):
    """[notes]: who owns a plan, and tags to find its runs by; ``ftcore runs`` shows them."""

    name = "notes"
    Options = Notes
    fingerprint = False  # editing the notes does not make a finished run another run

    def check(self, plan) -> list[str]:
        tags = self.options.tags if self.options else []
        return [f"tags: {tag!r} is listed twice" for tag in sorted(set(tags)) if tags.count(tag) > 1]


def read_run(folder: Path) -> dict | None:
    """What a run directory says about itself, or ``None`` when the folder holds no ftcore run."""
    try:
        manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    stages = [s["name"] for s in manifest.get("resolved", {}).get("stages", [])]
    done = [name for name in stages if (folder / "stages" / name / "COMPLETE.json").exists()]
    notes = manifest.get("plan", {}).get("notes", {})
    return {"run": folder.name, "status": manifest.get("status", "?"),
            "started": str(manifest.get("started_at", "?"))[:19].replace("T", " "),
            "stages": f"{len(done)}/{len(stages)}", "metrics": _metrics(folder),
            "owner": notes.get("owner") or "", "tags": list(notes.get("tags", []))}


def _metrics(folder: Path) -> str:
    """The first metric of each evaluation, as "name: before -> after" (or the one phase there is)."""
    phases = {p.stem: p for p in (folder / "evaluations").glob("*.json")}
    values: dict[str, dict[str, float]] = {}
    for phase in ("before", "after"):
        if phase not in phases:
            continue
        try:
            results = json.loads(phases[phase].read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        for name, metrics in results.items():
            numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k != "n"}
            if numbers:
                key = next(iter(numbers))
                values.setdefault(f"{name}.{key}", {})[phase] = numbers[key]
    return ", ".join(f"{k}: " + " -> ".join(f"{v[p]:.4g}" for p in ("before", "after") if p in v)
                     for k, v in values.items())


class RunsCommand(Command):
    """List the runs in a folder: status, stages done, main metrics.

    One line per ftcore run directory under FOLDER (default: runs), newest first, read from the files
    each run wrote (manifest.json, stages/*/COMPLETE.json, evaluations/*.json).
    """

    name = "runs"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("folder", nargs="?", default="runs", help="the folder holding run directories")
        parser.add_argument("--json", action="store_true", help="machine-readable output")

    def run(self, args: argparse.Namespace) -> int:
        folder = Path(args.folder)
        if not folder.is_dir():
            raise FtcoreError(f"{folder}: no such folder; give the folder that holds your run directories")
        runs = [r for r in (read_run(p) for p in sorted(folder.iterdir()) if p.is_dir()) if r is not None]
        runs.sort(key=lambda r: r["started"], reverse=True)
        if args.json:
            print(json.dumps(runs, indent=2))
            return 0
        from rich.console import Console
        from rich.table import Table

        table = Table(box=None, padding=(0, 2), pad_edge=False)
        for column in ("run", "status", "started", "stages", "metrics", "owner", "tags"):
            table.add_column(column, overflow="fold")
        for r in runs:
            table.add_row(r["run"], r["status"], r["started"], r["stages"], r["metrics"], r["owner"],
                          ", ".join(r["tags"]))
        Console().print(table)
        if not runs:
            print(f"{folder}: no ftcore runs")
        return 0


@ftcore.hookimpl
def register_commands(register):
    register(RunsCommand)


@ftcore.hookimpl
def register_plan_sections(register):
    register(NotesSection)
