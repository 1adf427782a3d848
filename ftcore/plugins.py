"""The plugin manager: built-in plugins, entry-point plugins, and the component registry. Nothing here
runs at import time; call :func:`get_plugin_manager`."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pluggy

from . import __version__, hookspecs
from .component import KINDS
from .errors import FtcoreError, did_you_mean, one_line, warn
from .registry import Registration, Registry

ENTRY_POINT_GROUP = "ftcore"


def __getattr__(name: str) -> tuple[str, ...]:
    """``BUILTIN_PLUGINS`` and ``BUILTIN_COMMANDS``: the built-in plugins' modules, which the
    ``ftcore_plugins`` package lists (``COMPONENTS``, ``COMMANDS``)."""
    if name in ("BUILTIN_PLUGINS", "BUILTIN_COMMANDS"):
        return getattr(_builtin_package(), "COMPONENTS" if name == "BUILTIN_PLUGINS" else "COMMANDS")
    raise AttributeError(f"module 'ftcore.plugins' has no attribute {name!r}")


@dataclass
class PluginInfo:
    name: str
    dist: str
    version: str
    source: str  # "builtin" or "entry point"


class PluginManager(pluggy.PluginManager):
    """A pluggy manager that remembers where each plugin came from and what failed."""

    def __init__(self) -> None:
        super().__init__("ftcore")
        self.add_hookspecs(hookspecs)
        self.infos: dict[str, PluginInfo] = {}
        self.failures: list[str] = []
        self._registry: Registry | None = None
        self._warned: set[tuple[str, str]] = set()

    def add_plugin(self, obj: object, info: PluginInfo) -> None:
        try:
            self.register(obj, name=info.name)
        except Exception as exc:  # pluggy validates hook signatures here
            self.failures.append(f"{_who(info)} is not a valid plugin: {one_line(exc)}")
            return
        self.infos[info.name] = info

    def add_run_plugin(self, obj: object, reg: Any) -> str:
        """Register a component instance that implements lifecycle hooks (a tracker) for one run;
        returns its plugin name, for ``unregister(name=...)`` when the run ends."""
        name = f"{reg.kind}:{reg.name}"
        info = PluginInfo(name, reg.dist, reg.version, reg.plugin)
        unknown = [n for n in dir(obj) if not n.startswith("_") and self.parse_hookimpl_opts(obj, n) is not None
                   and not getattr(getattr(self.hook, n, None), "has_spec", lambda: False)()]
        if unknown:
            raise FtcoreError(f"{reg.kind} '{reg.name}' from {reg.who()} implements unknown hook "
                              f"'{unknown[0]}'{did_you_mean(unknown[0], _spec_names(self))}")
        try:
            self.register(obj, name=name)
        except Exception as exc:  # pluggy validates hook signatures here
            raise FtcoreError(f"{reg.kind} '{reg.name}' from {reg.who()} is not a valid plugin: {one_line(exc)}") \
                from None
        self.infos[name] = info
        return name

    def check_pending(self) -> None:
        """Unregister, and report, each plugin that implements a hook that does not exist."""
        specs = _spec_names(self)
        while True:
            try:
                super().check_pending()
                return
            except pluggy.PluginValidationError as exc:
                name = self.get_name(exc.plugin) or repr(exc.plugin)
                info = self.infos.pop(name, PluginInfo(name, "?", "?", "?"))
                bad = [
                    n for n in dir(self.hook)
                    if not n.startswith("_")
                    and not getattr(self.hook, n).has_spec()
                    and any(i.plugin is exc.plugin for i in getattr(self.hook, n).get_hookimpls())
                ]
                hints = "; ".join(f"unknown hook '{b}'{did_you_mean(b, specs)}" for b in bad)
                self.unregister(exc.plugin)
                self.failures.append(f"{_who(info)} was not loaded: {hints or one_line(exc)}")

    def notify(self, hook: str, **kwargs: object) -> list[str]:
        """Call a lifecycle hook on every plugin. A plugin that raises is reported, once
        per plugin and hook, and the others still run: a broken tracker must not end a
        long training run."""
        problems = []
        for impl in reversed(getattr(self.hook, hook).get_hookimpls()):  # pluggy's call order
            try:
                impl.function(**{name: kwargs[name] for name in impl.argnames})
            except Exception as exc:
                if (impl.plugin_name, hook) not in self._warned:
                    self._warned.add((impl.plugin_name, hook))
                    info = self.infos.get(impl.plugin_name) or PluginInfo(impl.plugin_name, "?", "?", "?")
                    problems.append(f"{_who(info)} failed in {hook}: {one_line(exc)} "
                                    "(the run goes on; later failures of this hook are not reported)")
        return problems

    def registry(self) -> Registry:
        """Collect every component, calling each plugin's registry hook on its own so a
        failure is attributed to the plugin that caused it."""
        if self._registry is not None:
            return self._registry
        from pydantic import BaseModel

        registry = Registry()
        for kind in KINDS.values():
            for impl in getattr(self.hook, kind.hook).get_hookimpls():
                info = self.infos.get(impl.plugin_name) or PluginInfo(impl.plugin_name, "?", "?", "?")

                def register(cls: type, _kind=kind, _info=info) -> None:
                    problem = _check_component(cls, _kind.methods, BaseModel)
                    if problem:
                        registry.problems.append(f"{_who(_info)} registered an invalid {_kind.id}: {problem}")
                        return
                    registry.add(Registration(_kind.id, cls.name, cls, _info.name, _info.dist, _info.version))

                try:
                    impl.function(register=register)
                except Exception as exc:
                    registry.problems.append(f"{_who(info)} failed in {kind.hook}: {one_line(exc)}")
        self._sections(registry)
        registry.problems[:0] = self.failures
        self._registry = registry
        return registry

    def _sections(self, registry: Registry) -> None:
        """The plan tables plugins own (``register_plan_sections``), into ``registry.sections``."""
        from .component import PlanSection
        from .plan import TOP_LEVEL

        for impl in reversed(self.hook.register_plan_sections.get_hookimpls()):  # registration order
            info = self.infos.get(impl.plugin_name) or PluginInfo(impl.plugin_name, "?", "?", "?")

            def register(cls: type, _info=info) -> None:
                name = getattr(cls, "name", None)
                if not (inspect.isclass(cls) and issubclass(cls, PlanSection)):
                    problem = f"expected a subclass of ftcore.component.PlanSection, got {cls!r}"
                elif not isinstance(name, str) or not name.isidentifier() or not name.islower():
                    problem = f"{cls.__qualname__} has no valid 'name' (a lower-case TOML key): {name!r}"
                elif name in TOP_LEVEL:
                    problem = f"{cls.__qualname__} names [{name}], which is ftcore's own table"
                else:
                    registry.add_section(Registration("plan section", name, cls, _info.name, _info.dist,
                                                      _info.version))
                    return
                registry.problems.append(f"{_who(_info)} registered an invalid plan section: {problem}")

            try:
                impl.function(register=register)
            except Exception as exc:
                registry.problems.append(f"{_who(info)} failed in register_plan_sections: {one_line(exc)}")


def get_plugin_manager(
    *, builtins: bool = True, entry_points: bool = True, components: bool = True,
    env: Mapping[str, str] | None = None,
) -> PluginManager:
    """Build a fresh plugin manager with the built-in and installed plugins. ``components=False`` imports
    the built-in commands alone (the command line's parser must stay fast); entry-point plugins are loaded
    either way. ``FTCORE_LOAD_PLUGINS`` (entry-point or distribution names, comma-separated) loads only
    those third-party plugins; ``FTCORE_DISABLE_PLUGINS`` skips the ones named, built-in modules included."""
    env = os.environ if env is None else env
    allow = _name_set(env.get("FTCORE_LOAD_PLUGINS"))
    block = _name_set(env.get("FTCORE_DISABLE_PLUGINS")) or set()
    pm = PluginManager()

    if builtins:
        package = _builtin_package()
        for module_name in (package.COMPONENTS if components else ()) + package.COMMANDS:
            if package.names(module_name) & block:
                continue
            info = PluginInfo(module_name, "ftcore", __version__, "builtin")
            try:
                module = importlib.import_module(module_name)
            except Exception as exc:
                pm.failures.append(f"{_who(info)} failed to import: {one_line(exc)}")
                continue
            pm.add_plugin(module, info)

    if entry_points:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            # A distribution without a name is one whose metadata is being written or is broken (a pip
            # install running beside this process): named "?" rather than failing every command.
            dist = (ep.dist.name if ep.dist else None) or "?"
            version = (ep.dist.version if ep.dist else None) or "?"
            names = {ep.name, dist, _normalize(dist)}
            if allow is not None and not names & allow:
                continue
            if names & block:
                continue
            info = PluginInfo(ep.name, dist, version, "entry point")
            if pm.has_plugin(ep.name):
                winner = pm.infos.get(ep.name) or PluginInfo(ep.name, "?", "?", "?")
                pm.failures.append(f"{_who(info)} was not loaded: {_who(winner)} is already named '{ep.name}' "
                                   "and was loaded first")
                continue
            try:
                obj = ep.load()
            except Exception as exc:
                pm.failures.append(f"{_who(info)} failed to import ({ep.value}): {one_line(exc)}")
                continue
            pm.add_plugin(obj, info)

    pm.check_pending()
    return pm


def plugins_with_warnings(quiet: bool = False) -> tuple[PluginManager, Registry]:
    """Every plugin and the component registry, each plugin problem printed once as a warning."""
    pm = get_plugin_manager()
    registry = pm.registry()
    if not quiet:
        for problem in registry.problems:
            warn(problem)
    return pm, registry


def _check_component(cls: object, methods: tuple[str, ...], base_model: type) -> str | None:
    if not inspect.isclass(cls):
        return f"expected a class, got {cls!r}"
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        return f"{cls.__qualname__} has no 'name'"
    missing = [m for m in methods if not callable(getattr(cls, m, None))]
    if missing:
        return f"{cls.__qualname__} ('{name}') lacks {', '.join(repr(m) for m in missing)}"
    options = getattr(cls, "Options", None)
    if not (inspect.isclass(options) and issubclass(options, base_model)):
        return f"{cls.__qualname__} ('{name}') has no pydantic 'Options' model"
    return None


def _builtin_package() -> Any:
    """``ftcore_plugins``, which lists the built-in plugins by module path: ``COMPONENTS`` (and plan
    sections), then ``COMMANDS``. In a plain source checkout (no install) it is ``plugins/``."""
    if "ftcore_plugins" not in sys.modules and importlib.util.find_spec("ftcore_plugins") is None:
        folder = Path(__file__).resolve().parent.parent / "plugins"
        spec = importlib.util.spec_from_file_location("ftcore_plugins", folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])
        module = importlib.util.module_from_spec(spec)
        sys.modules["ftcore_plugins"] = module
        spec.loader.exec_module(module)
    return importlib.import_module("ftcore_plugins")


def _spec_names(pm: pluggy.PluginManager) -> list[str]:
    return [n for n in dir(pm.hook) if not n.startswith("_") and getattr(pm.hook, n).has_spec()]


def _who(info: PluginInfo) -> str:
    return f"plugin '{info.name}' ({info.dist} {info.version})"


def _normalize(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _name_set(value: str | None) -> set[str] | None:
    if value is None:
        return None
    names = {v.strip() for v in value.split(",") if v.strip()}
    return names | {_normalize(v) for v in names}
