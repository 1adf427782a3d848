"""The ``ftcore`` command line.

Imports are deferred into each command: ``--help`` loads nothing heavy, and
``plugins``/``validate`` never import torch or transformers.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from typing import Any

from . import __version__


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show full tracebacks")

    parser = argparse.ArgumentParser(
        prog="ftcore",
        description="Fine-tune language models from a TOML plan, with swappable plugin components.",
        parents=[common],
    )
    parser.add_argument("--version", action="version", version=f"ftcore {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser("run", parents=[common], help="run a plan: load, train stages, evaluate, export",
                         description="Run a plan: data -> model -> adapter -> stages -> evaluate -> export.")
    run.add_argument("plan", help="path to plan.toml")
    run.add_argument("--resume", action="store_true",
                     help="continue the run in the plan's run directory: skip completed stages, "
                          "resume an interrupted stage from its last checkpoint")
    run.add_argument("--force", action="store_true",
                     help="start over even if the run directory holds a run (it is moved aside, not deleted)")

    val = sub.add_parser("validate", parents=[common], help="check a plan and list every problem, loading nothing",
                         description="Check a plan against the installed plugins. Exits 2 if it has problems.")
    val.add_argument("plan", help="path to plan.toml")

    plg = sub.add_parser("plugins", parents=[common], help="list installed components by kind and their plugins",
                         description="List every installed component, by kind, with the distribution providing it.")
    plg.add_argument("--json", action="store_true", help="machine-readable output")

    cache = sub.add_parser("cache", parents=[common], help="show or clear the tokenized-data cache",
                           description="The cache of tokenized datasets that runs share "
                                       "(FTCORE_CACHE_DIR, default ~/.cache/ftcore).")
    cache.add_argument("action", choices=("info", "clear"), nargs="?", default="info")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command is None:
        _parser().print_help()
        return 0
    from .errors import ComponentError, FtcoreError, PlanError

    try:
        commands = {"run": cmd_run, "validate": cmd_validate, "plugins": cmd_plugins, "cache": cmd_cache}
        return commands[args.command](args)
    except PlanError as exc:
        for line in exc.problems:
            print(line, file=sys.stderr)
        if args.debug:
            traceback.print_exc()
        return 2
    except FtcoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        if args.debug:
            traceback.print_exc()
        return exc.exit_code
    except ComponentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        if args.debug:
            traceback.print_exc()
        else:
            print("(run with --debug for the traceback)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; continue with: ftcore run PLAN --resume", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `ftcore plugins --json | head`
        sys.stderr.close()
        return 0


def _plugins(args: argparse.Namespace) -> Any:
    from .plugins import get_plugin_manager

    pm = get_plugin_manager()
    registry = pm.registry()
    if not getattr(args, "json", False):
        for problem in registry.problems:
            print(f"warning: {problem}", file=sys.stderr)
    return pm, registry


def cmd_plugins(args: argparse.Namespace) -> int:
    from .component import KINDS

    pm, registry = _plugins(args)
    if args.json:
        out = {
            "plugins": [vars(i) for i in pm.infos.values()],
            "components": {
                kind: [{"name": r.name, "qualified": r.qualified, "dist": r.dist, "version": r.version,
                        "plugin": r.plugin, "description": r.description} for r in registry.all(kind)]
                for kind in KINDS
            },
            "conflicts": registry.conflicts(),
            "problems": registry.problems,
        }
        print(json.dumps(out, indent=2))
        return 0
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    table = Table(box=None, padding=(0, 2), pad_edge=False)
    table.add_column("component", no_wrap=True)
    table.add_column("distribution", no_wrap=True, style="dim")  # plugin module paths are in --json
    table.add_column("description", min_width=20, ratio=1)
    for kind, spec in KINDS.items():
        table.add_row(f"[bold]{spec.title}[/]", "", "")
        for r in registry.all(kind):
            table.add_row(f"  [cyan]{escape(r.name)}[/]", escape(f"{r.dist} {r.version}"), escape(r.description))
        if not registry.all(kind):
            table.add_row("  (none)", "", "")
    console.print(table)
    for conflict in registry.conflicts():
        console.print(f"[red]conflict:[/] {conflict}", highlight=False)
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from .plan import load_plan

    _, registry = _plugins(args)
    plan = load_plan(args.plan, registry)
    stages = " -> ".join(f"{s.name} ({s.trainer.name}, {s.adapter.name})" for s in plan.stages) or "no stages"
    print(f"{args.plan}: OK: model '{plan.model.name}', {len(plan.data)} data, stages: {stages}; "
          f"{len(plan.evaluations)} evaluation(s), {len(plan.exports)} export(s); run dir {plan.run_dir}")
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    from . import cache

    path = cache.cache_dir()
    if args.action == "clear":
        print(f"cleared {path}: freed {cache.clear(path) / 2**20:.1f} MiB")
    else:
        files, total = cache.size(path) if path.exists() else (0, 0)
        print(f"{path}: {files} files, {total / 2**20:.1f} MiB")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .plan import load_plan
    from .runner import Runner
    from .summary import print_summary

    pm, registry = _plugins(args)
    plan = load_plan(args.plan, registry)
    console = Console(stderr=False)
    summary = Runner(plan, pm, console, resume=args.resume, force=args.force).run()
    print_summary(console, summary)
    return 0
