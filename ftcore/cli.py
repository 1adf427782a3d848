"""The ``ftcore`` command line.

Imports are deferred into each command: ``--help`` loads nothing heavy, and
``plugins``/``validate`` never import torch or transformers.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
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
    dist = run.add_argument_group("distributed", "override the plan's [distributed] section (docs/distributed.md)")
    dist.add_argument("--engine", choices=("ddp", "fsdp", "deepspeed"), help="how the processes share the work")
    for flag, kind, what in (("--nproc-per-node", int, "processes on this node (one per GPU)"),
                             ("--nnodes", int, "number of nodes"), ("--node-rank", int, "this node's rank"),
                             ("--master-addr", str, "rank 0's node address"),
                             ("--master-port", int, "a free port on rank 0's node")):
        dist.add_argument(flag, type=kind, help=what)

    val = sub.add_parser("validate", parents=[common], help="check a plan and list every problem, loading nothing",
                         description="Check a plan against the installed plugins. Exits 2 if it has problems.")
    val.add_argument("plan", help="path to plan.toml")

    plg = sub.add_parser("plugins", parents=[common], help="list installed components by kind and their plugins",
                         description="List every installed component, by kind, with the distribution providing it.")
    plg.add_argument("--json", action="store_true", help="machine-readable output")

    init = sub.add_parser("init", parents=[common], help="write a starter plan from a few answers",
                          description="Write a starter plan: method, rank, learning rate and epochs chosen from "
                                      "your GPU memory, data and goal, each explained in a comment. Answers not "
                                      "given as flags are asked for.")
    init.add_argument("-o", "--output", default="plan.toml", help="where to write the plan (default plan.toml)")
    init.add_argument("--model", help="base model: a local folder or a hub id")
    init.add_argument("--gpu-memory", help="GPU memory per device, e.g. 24GB (0 for CPU only)")
    init.add_argument("--data", help="training data file (JSON, JSON Lines)")
    init.add_argument("--kind", choices=("instructions", "chat", "preferences", "text"), help="what the data holds")
    init.add_argument("--rows", type=int, help="number of rows (counted from the file when omitted)")
    init.add_argument("--goal", choices=("task", "domain", "alignment"), help="what the fine-tune is for")
    init.add_argument("--kl", choices=("low", "high"), default=None,
                      help="alignment: how much staying close to the base model matters")
    init.add_argument("--name", help="run name (default: the plan file's name)")
    init.add_argument("--force", action="store_true", help="overwrite an existing plan file")

    est = sub.add_parser("estimate", parents=[common], help="predict each stage's peak memory, loading no weights",
                         description="Predict each stage's peak memory (weights, gradients, optimizer state, "
                                     "activations, overhead) from the model's config, on the meta device: no "
                                     "weights are loaded and nothing is downloaded. Exits 2 for a bad plan, 1 when "
                                     "--budget is given and a stage does not fit.")
    est.add_argument("plan", help="path to plan.toml")
    est.add_argument("--budget", help="memory available, e.g. 16GB or 800MB (binary units: 16GB = 16 GiB)")
    est.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                     help="where the run would train (default: cuda if this machine has one, else cpu)")
    est.add_argument("--json", action="store_true", help="machine-readable output")

    cache = sub.add_parser("cache", parents=[common], help="show or clear the tokenized-data cache",
                           description="The cache of tokenized datasets that runs share "
                                       "(FTCORE_CACHE_DIR, default ~/.cache/ftcore).")
    cache.add_argument("action", choices=("info", "clear"), nargs="?", default="info")

    rep = sub.add_parser("report", parents=[common], help="write a run's report.html and report.md again",
                         description="Write report.html, report.md and the plots under report/ into a run "
                                     "directory, from its files alone (a failed run's too).")
    rep.add_argument("run_dir", help="the run directory, e.g. runs/<name>")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    code = _main(argv)
    if os.environ.get("FTCORE_LAUNCH_DIR"):  # a worker: tell our launcher how this rank ended
        from .launch import record_exit

        record_exit(code)
    return code


def _main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    args.argv = argv
    if args.command is None:
        _parser().print_help()
        return 0
    from .errors import ComponentError, FtcoreError, PlanError

    try:
        commands = {"run": cmd_run, "validate": cmd_validate, "plugins": cmd_plugins, "cache": cmd_cache,
                    "init": cmd_init, "estimate": cmd_estimate,
                    "report": cmd_report}
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
    except KeyboardInterrupt as exc:
        print(getattr(exc, "message", None) or "interrupted; continue with: ftcore run PLAN --resume",
              file=sys.stderr)
        return getattr(exc, "exit_code", 130)
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


def cmd_init(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    from . import init
    from .errors import FtcoreError

    out = Path(args.output)
    if out.exists() and not args.force:
        raise FtcoreError(f"{out}: already exists; choose another --output, or --force to overwrite it")
    interactive = sys.stdin.isatty()
    questions = {
        "model": ("Base model (local folder or hub id)", None, None),
        "gpu_memory": ("GPU memory per device, e.g. 24GB (0 for CPU only)", "0", None),
        "data": ("Training data file", None, None),
        "kind": ("What the data holds", "instructions", init.KINDS),
        "goal": ("What the fine-tune is for", "task", init.GOALS),
    }
    values = {}
    for key, (prompt, default, choices) in questions.items():
        value = getattr(args, key)
        if value is None and interactive:
            value = init.ask(prompt, default, choices)
        if value is None:
            raise FtcoreError(f"init: --{key.replace('_', '-')} is required when not asked interactively")
        values[key] = value
    kl = args.kl or ("low" if values["goal"] != "alignment" or not interactive
                     else init.ask("How much must the model stay close to the base (KL importance)", "low",
                                   ("low", "high")))
    try:
        gb = init.parse_gb(values["gpu_memory"])
    except ValueError as exc:
        raise FtcoreError(f"init: --gpu-memory: {exc}") from None
    data = Path(values["data"])
    rows = args.rows if args.rows is not None else init.count_rows(data)
    if rows is None:
        raise FtcoreError(f"init: cannot count the rows of {data}; give --rows")
    # Paths in a plan are relative to the plan's own folder.
    data_ref = os.path.relpath(data.resolve(), out.resolve().parent) if data.exists() else str(data)
    model = values["model"]
    if Path(model).exists():
        model = os.path.relpath(Path(model).resolve(), out.resolve().parent)
    answers = init.Answers(model=model, gpu_memory_gb=gb, data=data_ref, kind=values["kind"], rows=rows,
                           goal=values["goal"], kl=kl, name=args.name or out.stem)
    out.write_text(init.write_plan(answers), encoding="utf-8")
    print(f"wrote {out}: {init.method(gb)[0]}, {rows:,} rows; check it with: ftcore validate {out}")
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
    flags = ("engine", "nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port")
    plan = load_plan(args.plan, registry, {k: getattr(args, k) for k in flags if getattr(args, k) is not None})
    from . import launch

    if plan.distributed.wanted and not launch.is_worker():
        d = plan.distributed
        print(f"ftcore: starting {d.nproc_per_node} process(es) on this node ({d.engine}, node {d.node_rank} of "
              f"{d.nnodes})" if d.accelerate_config is None else f"ftcore: starting accelerate launch with "
              f"{d.accelerate_config}", file=sys.stderr)
        return launch.launch(d, args.argv)
    launch.start_worker(plan.distributed)
    console = Console(stderr=False)
    # SIGTERM outside a training stage ends the run like Ctrl-C (manifest "interrupted", exit 143); a
    # training stage replaces this handler with its own, which first saves a checkpoint.
    previous = signal.signal(signal.SIGTERM, _terminated(args.plan))
    try:
        summary = Runner(plan, pm, console, resume=args.resume, force=args.force).run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    print_summary(console, summary)
    return 0


def _terminated(plan: str):
    from .errors import Interrupted

    def handler(signum, frame):
        raise Interrupted(f"terminated (SIGTERM); resume with: ftcore run {plan} --resume", 128 + signum)

    return handler


def cmd_estimate(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .estimate import main_estimate
    from .plan import load_plan

    _, registry = _plugins(args)
    plan = load_plan(args.plan, registry)
    return main_estimate(plan, device=args.device, budget=args.budget, as_json=args.json, console=Console())


def cmd_report(args: argparse.Namespace) -> int:
    from .report import write_report

    html_path, md_path = write_report(args.run_dir)
    print(f"wrote {html_path} and {md_path}")
    return 0
