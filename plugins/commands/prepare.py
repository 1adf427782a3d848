"""``ftcore prepare``: only the data preparation of a plan, into the tokenized-data cache."""

from __future__ import annotations

import argparse

import ftcore
from ftcore.command import Command


class PrepareCommand(Command):
    """Tokenize a plan's data into the cache, without training.

    Runs each stage's data preparation (rendering, tokenization, labels, length limits, the
    packing report) into the tokenized-data cache that runs share (FTCORE_CACHE_DIR), with a
    progress bar, so that `ftcore run` (or a cluster job) starts from a ready cache: axolotl's
    `preprocess`. It reads the tokenizer and the model's config, never its weights, and writes
    nothing in the run folder. A preparation that is killed resumes from its finished shards.
    """

    name = "prepare"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("plan", help="the plan (TOML)")
        parser.add_argument("--stage", action="append", metavar="NAME",
                            help="only this stage's data (repeat for several)")

    def run(self, args: argparse.Namespace) -> int:
        from rich.console import Console

        from ftcore_plugins.common.cache import cache_dir
        from ftcore_plugins.commands.quiet import quiet_libraries

        quiet_libraries(verbose=args.debug)
        from ftcore.runner import Runner

        from ftcore_plugins.common.run_data import prepare_data

        plan, pm = self.load_plan(args.plan)
        console = Console()
        for stage, outcome in prepare_data(Runner(plan, pm, console), args.stage):
            console.print(f"stage [bold]{stage}[/]: {outcome}", highlight=False)
        console.print(f"cache: {cache_dir() / 'tokenized'}", highlight=False)
        return 0


@ftcore.hookimpl
def register_commands(register):
    register(PrepareCommand)


@ftcore.hookimpl
def ftcore_prepare_data(run, stages, load_data):
    """``ftcore run`` prepares the data of the stages it is about to train as ``ftcore prepare`` does,
    before the model loads: a bad row stops it there. Then it warns about rows with images that reach a
    trainer or evaluator that does not say it reads them."""
    from ftcore_plugins.common.run_data import prepare_before_load, warn_unread_images

    prepare_before_load(run, stages, load_data)
    warn_unread_images(run, stages, load_data)
