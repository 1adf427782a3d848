"""The plugin manager: built-in plugins, entry-point plugins, and the component registry.

Nothing here runs at import time; call :func:`get_plugin_manager`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import sys
from collections.abc import Mapping
from typing import Any
from dataclasses import dataclass
from pathlib import Path

import pluggy

from . import __version__, hookspecs
from .component import KINDS
from .errors import FtcoreError, did_you_mean
from .registry import Registration, Registry

ENTRY_POINT_GROUP = "ftcore"

# Registered by module path, through the same hooks a third party uses.
BUILTIN_PLUGINS = (
    "ftcore_plugins.models.hf",
    "ftcore_plugins.models.scratch",
    "ftcore_plugins.data.jsonl",
    "ftcore_plugins.data.json",
    "ftcore_plugins.data.csv",
    "ftcore_plugins.data.parquet",
    "ftcore_plugins.data.text",
    "ftcore_plugins.data.arrow",
    "ftcore_plugins.data.hf",
    "ftcore_plugins.data.mix",
    "ftcore_plugins.templates.chatml",
    "ftcore_plugins.templates.native",
    "ftcore_plugins.templates.llama2",
    "ftcore_plugins.templates.llama3",
    "ftcore_plugins.templates.mistral",
    "ftcore_plugins.templates.gemma",
    "ftcore_plugins.templates.phi3",
    "ftcore_plugins.templates.qwen25",
    "ftcore_plugins.templates.qwen3",
    "ftcore_plugins.templates.llama31",
    "ftcore_plugins.templates.mistral_v3",
    "ftcore_plugins.templates.tekken",
    "ftcore_plugins.templates.gemma3",
    "ftcore_plugins.templates.phi4",
    "ftcore_plugins.templates.deepseek_r1",
    "ftcore_plugins.templates.gpt_oss",
    "ftcore_plugins.templates.alpaca",
    "ftcore_plugins.templates.vicuna",
    "ftcore_plugins.templates.zephyr",
    "ftcore_plugins.templates.jinja",
    "ftcore_plugins.adapters.lora",
    "ftcore_plugins.adapters.dora",
    "ftcore_plugins.adapters.rslora",
    "ftcore_plugins.adapters.pissa",
    "ftcore_plugins.adapters.olora",
    "ftcore_plugins.adapters.loftq",
    "ftcore_plugins.adapters.loraplus",
    "ftcore_plugins.adapters.ia3",
    "ftcore_plugins.adapters.prompt_tuning",
    "ftcore_plugins.adapters.prefix_tuning",
    "ftcore_plugins.adapters.full",
    "ftcore_plugins.adapters.freeze",
    "ftcore_plugins.quantizers.none",
    "ftcore_plugins.quantizers.bnb_nf4",
    "ftcore_plugins.quantizers.bnb_fp4",
    "ftcore_plugins.quantizers.bnb_int8",
    "ftcore_plugins.trainers.sft",
    "ftcore_plugins.trainers.pretrain",
    "ftcore_plugins.evaluators.perplexity",
    "ftcore_plugins.evaluators.exact_match",
    "ftcore_plugins.evaluators.compare",
    "ftcore_plugins.evaluators.forgetting",
    "ftcore_plugins.evaluators.preference",
    "ftcore_plugins.exporters.adapter",
    "ftcore_plugins.exporters.merged",
    "ftcore_plugins.rewards.contains",
    "ftcore_plugins.rewards.regex",
    "ftcore_plugins.trainers.grpo",
    "ftcore_plugins.trainers.rloo",
    "ftcore_plugins.trainers.ppo",
    "ftcore_plugins.trackers.tensorboard",
    "ftcore_plugins.trackers.mlflow",
    "ftcore_plugins.trackers.wandb",
    "ftcore_plugins.trainers.dpo",
    "ftcore_plugins.trainers.kto",
    "ftcore_plugins.trainers.orpo",
    "ftcore_plugins.trainers.reward",
    "ftcore_plugins.evaluators.generation",
    "ftcore_plugins.evaluators.lm_eval",
    "ftcore_plugins.exporters.onnx",
    "ftcore_plugins.exporters.gguf",
    "ftcore_plugins.exporters.mlflow",
)

# Built-in subcommands beyond run/validate/plugins; `ftcore --help` imports these and no other built-in.
BUILTIN_COMMANDS = (
    "ftcore_plugins.commands.init",
    "ftcore_plugins.commands.estimate",
    "ftcore_plugins.commands.report",
    "ftcore_plugins.commands.cache",
    "ftcore_plugins.commands.prepare",
    "ftcore_plugins.commands.check",
    "ftcore_plugins.commands.lr_find",
    "ftcore_plugins.commands.sweep",
    "ftcore_plugins.commands.chat",
    "ftcore_plugins.commands.generate",
)

# The commands the core itself defines (ftcore/cli.py); a plugin cannot replace them.
CORE_COMMANDS = ("run", "validate", "plugins")


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
        self._commands: tuple[dict[str, Any], list[str]] | None = None
        self._warned: set[tuple[str, str]] = set()

    def add_plugin(self, obj: object, info: PluginInfo) -> None:
        try:
            self.register(obj, name=info.name)
        except Exception as exc:  # pluggy validates hook signatures here
            self.failures.append(f"{_who(info)} is not a valid plugin: {_one_line(exc)}")
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
            raise FtcoreError(f"{reg.kind} '{reg.name}' from {reg.who()} is not a valid plugin: {_one_line(exc)}") \
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
                self.failures.append(f"{_who(info)} was not loaded: {hints or _one_line(exc)}")

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
                    problems.append(f"{_who(info)} failed in {hook}: {_one_line(exc)} "
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
                    registry.problems.append(f"{_who(info)} failed in {kind.hook}: {_one_line(exc)}")
        registry.problems[:0] = self.failures
        self._registry = registry
        return registry


    def commands(self) -> tuple[dict[str, Any], list[str]]:
        """Every registered command by name, and the problems met collecting them. A name clash is a
        warning naming the winner: the core's commands, then built-in ones, then the first loaded."""
        if self._commands is not None:
            return self._commands
        from .command import CommandInfo, check_command

        found: dict[str, CommandInfo] = {}
        problems: list[str] = []
        for impl in reversed(self.hook.register_commands.get_hookimpls()):  # registration order
            info = self.infos.get(impl.plugin_name) or PluginInfo(impl.plugin_name, "?", "?", "?")

            def register(cls: type, _info=info) -> None:
                problem = check_command(cls)
                if problem:
                    problems.append(f"{_who(_info)} registered an invalid command: {problem}")
                    return
                new = CommandInfo(cls.name, cls, _info.name, _info.dist, _info.version)
                if cls.name in CORE_COMMANDS:
                    problems.append(f"{new.who()} registered the command '{cls.name}', which is ftcore's own; "
                                    "ignored")
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
                problems.append(f"{_who(info)} failed in register_commands: {_one_line(exc)}")
        self._commands = (found, problems)
        return self._commands


def get_plugin_manager(
    *, builtins: bool = True, entry_points: bool = True, components: bool = True,
    env: Mapping[str, str] | None = None,
) -> PluginManager:
    """Build a fresh plugin manager with the built-in and installed plugins.

    ``components=False`` imports the built-in commands alone (for the command line's parser,
    which must stay fast); entry-point plugins are loaded either way.

    ``FTCORE_LOAD_PLUGINS`` (comma-separated entry-point or distribution names) loads
    only those third-party plugins; ``FTCORE_DISABLE_PLUGINS`` skips the ones named,
    built-in module paths included.
    """
    env = os.environ if env is None else env
    allow = _name_set(env.get("FTCORE_LOAD_PLUGINS"))
    block = _name_set(env.get("FTCORE_DISABLE_PLUGINS")) or set()
    pm = PluginManager()

    if builtins:
        _ensure_builtin_package()
        for module_name in (BUILTIN_PLUGINS if components else ()) + BUILTIN_COMMANDS:
            if _builtin_names(module_name) & block:
                continue
            info = PluginInfo(module_name, "ftcore", __version__, "builtin")
            try:
                module = importlib.import_module(module_name)
            except Exception as exc:
                pm.failures.append(f"{_who(info)} failed to import: {_one_line(exc)}")
                continue
            pm.add_plugin(module, info)

    if entry_points:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = ep.dist.name if ep.dist else "?"
            version = ep.dist.version if ep.dist else "?"
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
                pm.failures.append(f"{_who(info)} failed to import ({ep.value}): {_one_line(exc)}")
                continue
            pm.add_plugin(obj, info)

    pm.check_pending()
    return pm


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


def _ensure_builtin_package() -> None:
    """Make ``ftcore_plugins`` importable from a plain source checkout (no install)."""
    if "ftcore_plugins" in sys.modules or importlib.util.find_spec("ftcore_plugins") is not None:
        return
    folder = Path(__file__).resolve().parent.parent / "plugins"
    spec = importlib.util.spec_from_file_location(
        "ftcore_plugins", folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["ftcore_plugins"] = module
    spec.loader.exec_module(module)


# Each folder's prefix in the flat layout before 0.2, so FTCORE_DISABLE_PLUGINS=eval_perplexity still works.
_FLAT_PREFIX = {"models": "model_", "data": "data_", "templates": "template_", "adapters": "adapter_",
                "quantizers": "quantizer_", "trainers": "trainer_", "evaluators": "eval_", "exporters": "export_",
                "trackers": "tracker_", "rewards": "reward_", "commands": "command_"}


def _builtin_names(module_name: str) -> set[str]:
    """The names FTCORE_DISABLE_PLUGINS matches for a built-in module: its path
    (``ftcore_plugins.evaluators.perplexity``), the path in the package (``evaluators.perplexity``)
    and the flat name it had before (``eval_perplexity``)."""
    inner = module_name.removeprefix("ftcore_plugins.")
    folder, _, stem = inner.rpartition(".")
    return {module_name, inner, _FLAT_PREFIX.get(folder, "") + stem}


def _spec_names(pm: pluggy.PluginManager) -> list[str]:
    return [n for n in dir(pm.hook) if not n.startswith("_") and getattr(pm.hook, n).has_spec()]


def _who(info: PluginInfo) -> str:
    return f"plugin '{info.name}' ({info.dist} {info.version})"


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _normalize(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _name_set(value: str | None) -> set[str] | None:
    if value is None:
        return None
    return {_normalize(v.strip()) for v in value.split(",") if v.strip()} | {
        v.strip() for v in value.split(",") if v.strip()
    }
