"""Which components are installed, who provided them, and name resolution."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .component import KINDS
from .errors import unknown_choice, warn

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
BUILTIN_DIST = "ftcore"  # the distribution of the built-in components


@dataclass(frozen=True)
class Registration:
    kind: str
    name: str
    cls: type
    plugin: str  # plugin name in the plugin manager (module path or entry-point name)
    dist: str  # distribution that provided the plugin
    version: str

    @property
    def qualified(self) -> str:
        return f"{self.dist}:{self.name}"

    @property
    def description(self) -> str:
        """The docstring's first paragraph, on one line: a summary wrapped over several lines is
        shown whole, never cut at the first line break."""
        return first_paragraph(self.cls.__doc__)

    def who(self) -> str:
        return f"plugin '{self.plugin}' ({self.dist} {self.version})"


@dataclass
class Registry:
    """All registered components, by kind and name. When two plugins register one name, the bare name
    means the built-in, if one is (with a warning naming the other and how to select it), so a plugin
    cannot break plans that use the built-in; between two third parties it is an error. The qualified
    ``dist:name`` always picks one."""

    entries: dict[str, dict[str, list[Registration]]] = field(
        default_factory=lambda: {k: {} for k in KINDS}
    )
    problems: list[str] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)  # bare names resolved to a shadowed built-in
    sections: dict[str, list[Registration]] = field(default_factory=dict)  # plan table -> the plugins owning it

    def add(self, reg: Registration) -> None:
        if not _NAME.match(reg.name):
            self.problems.append(
                f"{reg.who()} registered the {reg.kind} name {reg.name!r}, which is invalid "
                "(use letters, digits, '_', '-', '.')"
            )
            return
        same = self.entries[reg.kind].setdefault(reg.name, [])
        if any(r.plugin == reg.plugin for r in same):
            self.problems.append(f"{reg.who()} registered the {reg.kind} '{reg.name}' twice")
            return
        same.append(reg)

    def add_section(self, reg: Registration) -> None:
        """A plan table a plugin owns. A second owner is a problem, and a plan that writes the table
        is refused (``plan.py``), as the bare name of a component two third parties register is."""
        owners = self.sections.setdefault(reg.name, [])
        if owners:
            self.problems.append(f"{reg.who()} and {owners[0].who()} both own the plan table [{reg.name}]; "
                                 "a plan that writes it is refused until one of them is uninstalled")
        owners.append(reg)

    def names(self, kind: str) -> list[str]:
        return sorted(self.entries[kind])

    def all(self, kind: str) -> list[Registration]:
        return [r for name in self.names(kind) for r in self.entries[kind][name]]

    def conflicts(self) -> list[str]:
        out = []
        for kind, by_name in self.entries.items():
            for name, regs in sorted(by_name.items()):
                if len(regs) > 1:
                    builtin = _builtin(regs)
                    out.append(_shadow(kind, name, builtin, regs) if builtin else _clash(kind, name, regs))
        return out

    def resolve(self, kind: str, name: str) -> Registration:
        """Find the component a plan names, or raise ``LookupError`` with a one-line reason."""
        by_name = self.entries[kind]
        if ":" in name:
            dist, _, bare = name.partition(":")
            for reg in by_name.get(bare, []):
                if _norm(reg.dist) == _norm(dist) or reg.plugin == dist:
                    return reg
            providers = sorted(r.qualified for r in by_name.get(bare, []))
            if providers:
                raise LookupError(f"no {kind} {name!r}; '{bare}' is provided by: {', '.join(providers)}")
            raise LookupError(unknown_choice(kind, bare, by_name))
        regs = by_name.get(name)
        if not regs:
            raise LookupError(unknown_choice(kind, name, by_name))
        if len(regs) > 1:
            builtin = _builtin(regs)
            if builtin is None:
                raise LookupError(_clash(kind, name, regs))
            self._notice(_shadow(kind, name, builtin, regs))
            return builtin
        return regs[0]

    def _notice(self, message: str) -> None:
        if message not in self.notices:
            self.notices.append(message)
        warn(message)


def _norm(dist: str) -> str:
    return dist.lower().replace("_", "-").replace(".", "-")


def first_paragraph(doc: str | None) -> str:
    """A docstring's first paragraph (up to the first blank line), joined into one line."""
    text = (doc or "").strip()
    return " ".join(re.split(r"\n\s*\n", text, maxsplit=1)[0].split()) if text else ""


def _builtin(regs: list[Registration]) -> Registration | None:
    builtins = [r for r in regs if r.dist == BUILTIN_DIST]
    return builtins[0] if len(builtins) == 1 else None


def _shadow(kind: str, name: str, builtin: Registration, regs: list[Registration]) -> str:
    others = [r for r in regs if r is not builtin]
    who = " and ".join(r.who() for r in others)
    pick = " or ".join(f"'{r.qualified}'" for r in others)
    return (f"{who} also registers the {kind} '{name}'; the bare name '{name}' means the built-in "
            f"({builtin.qualified}); to use the plugin's, write {pick}")


def _clash(kind: str, name: str, regs: list[Registration]) -> str:
    who = " and ".join(r.who() for r in regs)
    pick = " or ".join(f"'{r.qualified}'" for r in regs)
    return f"{kind} '{name}' is registered by both {who}; choose one explicitly: {pick}"
