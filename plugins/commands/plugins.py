"""``ftcore plugins``: every installed component, by kind, and every command, with where each comes from.

It imports every plugin module and calls its registry hooks, and nothing heavier: listing stays fast
(no torch, no transformers)."""

from __future__ import annotations

import argparse
import json

import ftcore
from ftcore.command import CORE_COMMANDS, Command, commands as collect_commands
from ftcore.component import KINDS
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


@ftcore.hookimpl
def register_commands(register):
    register(PluginsCommand)
