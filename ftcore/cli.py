"""The ``ftcore`` command line: ``ftcore run``, and the commands plugins register (``validate``, ...).
Imports are deferred into each command: ``--help`` loads nothing heavy."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import traceback
from typing import Any

from . import __version__


def _parser(commands: dict[str, Any]) -> argparse.ArgumentParser:
    # `--debug` before or after the command: the subcommand's copy only sets it when given.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks")

    parser = argparse.ArgumentParser(
        prog="ftcore",
        description="Fine-tune language models from a TOML plan, with swappable plugin components.",
    )
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")
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

    # Commands from plugins (built-in ones too), in name order after the core's own.
    for name in sorted(commands):
        info = commands[name]
        cmd = sub.add_parser(name, parents=[common], help=info.help, description=info.description,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
        info.cls().add_arguments(cmd)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # Before torch loads its OpenMP runtime, which reads it once: threads that wait for work sleep
    # instead of spinning. Spinning threads make a run beside other busy processes several times
    # slower (benchmarks/contention.py); a user's own setting wins. Workers inherit it.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return _main(argv)


def _main(argv: list[str]) -> int:
    from .command import commands as collect_commands
    from .plugins import get_plugin_manager, warn

    # Commands come from plugins; building the parser imports no component, so --help stays fast.
    pm = get_plugin_manager(components=False)
    commands, problems = collect_commands(pm)
    quiet = "--json" in argv  # machine-readable output carries the problems itself
    if not quiet:
        for problem in [*pm.failures, *problems]:
            warn(problem)
    args = _parser(commands).parse_args(argv)
    args.argv = argv
    if args.command is None:
        _parser(commands).print_help()
        return 0
    from .errors import ComponentError, FtcoreError, PlanError

    for problem in pm.notify("ftcore_cli_start", command=args.command, debug=args.debug):
        warn(problem)
    try:
        if args.command == "run":
            return cmd_run(args)
        return commands[args.command].cls().run(args)
    except FtcoreError as exc:  # a plan's problems one a line, else one line
        print(*(exc.problems if isinstance(exc, PlanError) else [f"error: {exc}"]), sep="\n", file=sys.stderr)
        if args.debug:
            traceback.print_exc()
        return exc.exit_code
    except ComponentError as exc:
        if args.debug:
            print(f"error: {exc}", file=sys.stderr)
            traceback.print_exc()
        else:  # one line, the hint folded in
            print(f"error: {exc} (run with --debug for the traceback)", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        print(_interrupted(args, getattr(exc, "message", None)), file=sys.stderr)
        return getattr(exc, "exit_code", 130)
    except BrokenPipeError:  # `ftcore plugins --json | head`
        sys.stderr.close()
        return 0


def _interrupted(args: argparse.Namespace, message: str | None) -> str:
    """What the CLI says when Ctrl-C (or a second one) stopped it: the message the run raised, else how to
    go on, with the plan named as the user named it."""
    plan = getattr(args, "plan", None)
    again = f"ftcore run {shlex.quote(plan)} --resume" if isinstance(plan, str) and args.command == "run" else None
    if message:
        return message.replace("ftcore run <plan> --resume", again) if again else message
    return f"interrupted; continue with: {again}" if again else "interrupted"


def cmd_run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .plan import load_plan
    from .plugins import plugins_with_warnings, warn
    from .runner import Runner

    pm, registry = plugins_with_warnings()
    flags = ("engine", "nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port")
    overrides = {k: getattr(args, k) for k in flags if getattr(args, k) is not None}
    plan = load_plan(args.plan, registry, {"distributed": overrides} if overrides else None)
    for section in plan.sections.values():  # [distributed] runs the plan in several processes
        code = section.launch(plan, args.argv)
        if code is not None:
            return code
    console = Console(stderr=False)
    # SIGTERM outside a training stage ends the run like Ctrl-C (manifest "interrupted", exit 143); a
    # training stage replaces this handler with its own, which first saves a checkpoint.
    previous = signal.signal(signal.SIGTERM, _terminated(args.plan))
    try:
        summary = Runner(plan, pm, console, resume=args.resume, force=args.force).run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    for problem in pm.notify("ftcore_run_summary", console=console, summary=summary):  # the end-of-run tables
        warn(problem)
    return 0


def _terminated(plan: str):
    from .errors import Interrupted

    def handler(signum, frame):
        raise Interrupted(f"terminated (SIGTERM); resume with: ftcore run {plan} --resume", 128 + signum)

    return handler


if __name__ == "__main__":  # `python -m ftcore.cli`, as `python -m ftcore`: the module as imported, not a copy
    from ftcore.cli import main as _main_of_the_module

    raise SystemExit(_main_of_the_module())
