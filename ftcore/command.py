"""Subcommands of ``ftcore`` that plugins add through ``register_commands`` (docs/writing-plugins.md).
Nothing here imports more than the standard library, so ``ftcore --help`` stays fast."""

from __future__ import annotations

import argparse
import inspect
import re
from dataclasses import dataclass
from typing import Any, ClassVar

_NAME = re.compile(r"^[a-z][a-z0-9-]*$")
# The command the core itself defines (ftcore/cli.py); a plugin cannot replace it. The others, ``ftcore
# validate`` and ``ftcore plugins`` too, are plugins' (``ftcore_plugins.commands``).
CORE_COMMANDS = ("run",)


class Command:
    """Base class of ``ftcore`` subcommands."""

    name: ClassVar[str] = ""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Declare the command's arguments (``--debug`` is added for every command)."""

    def run(self, args: argparse.Namespace) -> int:
        """Do the work; return the exit status (0 for success)."""
        raise NotImplementedError

    @staticmethod
    def load_plan(path: str, overrides: dict | None = None) -> tuple[Any, Any]:
        """``(plan, plugin_manager)``, the plan checked as ``ftcore run`` checks it (plugin problems printed
        as warnings; a bad plan raises :class:`ftcore.errors.PlanError`)."""
        from .plan import load_plan
        from .plugins import plugins_with_warnings

        pm, registry = plugins_with_warnings()
        return load_plan(path, registry, overrides or {}), pm


@dataclass(frozen=True)
class CommandInfo:
    """A registered command and where it came from."""

    name: str
    cls: type[Command]
    plugin: str
    dist: str
    version: str

    @property
    def help(self) -> str:
        doc = inspect.getdoc(self.cls) or ""
        line = doc.split("\n\n")[0].replace("\n", " ").rstrip(".")
        # `ftcore --help` lists commands in argparse's style: "report  write a run's report ..."
        return line[:1].lower() + line[1:] if line[1:2].islower() else line

    @property
    def description(self) -> str:
        return inspect.getdoc(self.cls) or ""

    def who(self) -> str:
        return f"plugin '{self.plugin}' ({self.dist} {self.version})"


def check_command(cls: object) -> str | None:
    """Why ``cls`` cannot be a command, or ``None``."""
    if not (inspect.isclass(cls) and issubclass(cls, Command)):
        return f"expected a subclass of ftcore.command.Command, got {cls!r}"
    if not isinstance(cls.name, str) or not _NAME.match(cls.name):
        return f"{cls.__qualname__} has no valid 'name' (lower-case letters, digits and '-'): {cls.name!r}"
    if cls.run is Command.run:
        return f"{cls.__qualname__} ('{cls.name}') does not implement run(args)"
    return None


def commands(pm: Any) -> tuple[dict[str, CommandInfo], list[str]]:
    """Every command the plugins of ``pm`` register, by name, and the problems met collecting them (a
    name clash: the core's command wins, then a built-in one, then the first loaded)."""
    from .plugins import PluginInfo, one_line

    found: dict[str, CommandInfo] = {}
    problems: list[str] = []
    for impl in reversed(pm.hook.register_commands.get_hookimpls()):  # registration order
        info = pm.infos.get(impl.plugin_name) or PluginInfo(impl.plugin_name, "?", "?", "?")
        who = f"plugin '{info.name}' ({info.dist} {info.version})"

        def register(cls: type, _info=info, _who=who) -> None:
            problem = check_command(cls)
            if problem:
                problems.append(f"{_who} registered an invalid command: {problem}")
                return
            new = CommandInfo(cls.name, cls, _info.name, _info.dist, _info.version)
            if cls.name in CORE_COMMANDS:
                problems.append(f"{new.who()} registered the command '{cls.name}', which is ftcore's own; ignored")
                return
            old = found.get(cls.name)
            if old is not None:
                winner, loser = (new, old) if new.dist == "ftcore" and old.dist != "ftcore" else (old, new)
                found[cls.name] = winner
                problems.append(f"command '{cls.name}' is registered by both {winner.who()} and {loser.who()}; "
                                f"`ftcore {cls.name}` runs the one from {winner.who()}")
                return
            found[cls.name] = new

        try:
            impl.function(register=register)
        except Exception as exc:
            problems.append(f"{who} failed in register_commands: {one_line(exc)}")
    return found, problems
