"""``ftcore plugins``: every installed component, by kind, and every command, with where each comes from.

It imports every plugin module and calls its registry hooks, and nothing heavier: listing stays fast
(no torch, no transformers). The plan's ``requires`` (the distributions a plan needs) is this module's
too: it checks them against what is installed."""

from __future__ import annotations

import argparse
import json
from typing import Any

import ftcore
from ftcore.command import CORE_COMMANDS, Command, commands as collect_commands
from ftcore.component import KINDS, PlanSection
from ftcore.plan import type_name
from ftcore.plugins import plugins_with_warnings


class PluginsCommand(Command):
    """List installed components and commands by kind.

    Every installed component, by kind, and every command, with the distribution providing it.
    """

    name = "plugins"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--json", action="store_true", help="machine-readable output")

    def run(self, args: argparse.Namespace) -> int:
        pm, registry = plugins_with_warnings(quiet=args.json)  # --json carries the problems itself
        commands, command_problems = collect_commands(pm)
        if args.json:
            out = {
                "plugins": [vars(i) for i in pm.infos.values()],
                "components": {
                    kind: [{"name": r.name, "qualified": r.qualified, "dist": r.dist, "version": r.version,
                            "plugin": r.plugin, "description": r.description} for r in registry.all(kind)]
                    for kind in KINDS
                },
                "commands": [{"name": c.name, "dist": c.dist, "version": c.version, "plugin": c.plugin,
                              "description": c.help} for _, c in sorted(commands.items())],
                "conflicts": registry.conflicts(),
                "problems": registry.problems + command_problems,
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
        table.add_row("[bold]Commands[/]", "", "")
        for name in CORE_COMMANDS:
            table.add_row(f"  [cyan]{name}[/]", f"ftcore {ftcore.__version__}", "(ftcore's own)")
        for name, c in sorted(commands.items()):
            table.add_row(f"  [cyan]{escape(name)}[/]", escape(f"{c.dist} {c.version}"), escape(c.help))
        console.print(table)
        for conflict in registry.conflicts():
            console.print(f"[red]conflict:[/] {conflict}", highlight=False)
        return 0


class RequiresSection(PlanSection):
    """requires = [...]: the distributions (plugins, libraries) a plan needs, as pip requirements."""

    name = "requires"

    @classmethod
    def parse(cls, value: Any, problem: Any) -> list[str]:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            problem("requires", f"must be a list of requirement strings, got {type_name(value)}")
            return []
        from importlib.metadata import PackageNotFoundError, version

        from packaging.requirements import InvalidRequirement, Requirement

        for i, text in enumerate(value):
            try:
                req = Requirement(text)
            except InvalidRequirement as exc:
                reason = str(exc).splitlines()[0]  # packaging adds the text and a caret on further lines
                problem(f"requires[{i}]", f"not a valid requirement {text!r}: {reason}")
                continue
            try:
                have = version(req.name)
            except PackageNotFoundError:
                problem(f"requires[{i}]", f"{req.name} is not installed; install it with: pip install '{text}'")
                continue
            if req.specifier and not req.specifier.contains(have, prereleases=True):
                problem(f"requires[{i}]", f"{req.name} {have} is installed but the plan needs '{text}'; "
                                          f"upgrade with: pip install '{text}'")
        return list(value)

    @property
    def value(self) -> list[str]:
        return self.options or []


@ftcore.hookimpl
def register_commands(register):
    register(PluginsCommand)


@ftcore.hookimpl
def register_plan_sections(register):
    register(RequiresSection)
