"""``ftcore validate``: a plan checked against the installed plugins, loading nothing; with ``--data``, every
row the stages use too (``ftcore_plugins.data._check``)."""

from __future__ import annotations

import argparse
import importlib

import ftcore
from ftcore.command import Command


class ValidateCommand(Command):
    """Check a plan and list every problem, loading nothing.

    Check a plan against the installed plugins: each problem one line, and exit 2; or one OK line.
    """

    name = "validate"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("plan", help="path to plan.toml")
        parser.add_argument("--data", action="store_true",
                            help="also read, convert and render every row the stages use (loads the tokenizer, not "
                                 "the model); each bad row as FILE:LINE: message; exits 2 if a run would stop on one")

    def run(self, args: argparse.Namespace) -> int:
        plan, _ = self.load_plan(args.plan)
        stages = " -> ".join(f"{s.name} ({s.trainer.shown}, {s.adapter.shown})" for s in plan.stages) or "no stages"
        print(f"{args.plan}: OK: model '{plan.model.name}', {len(plan.data)} data, stages: {stages}; "
              f"{len(plan.evaluations)} evaluation(s), {len(plan.exports)} export(s); run dir {plan.run_dir}")
        if args.data:  # the data sources' own check of their rows, loaded only here (it imports datasets)
            return importlib.import_module("ftcore_plugins.data._check").check_plan_data(plan)
        return 0


@ftcore.hookimpl
def register_commands(register):
    register(ValidateCommand)
