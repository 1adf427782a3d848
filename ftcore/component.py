"""The base class of every component, and the kinds of component there are."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict


class Options(BaseModel):
    """Base for a component's options. Unknown keys are errors, not silently ignored, and so are
    ``inf`` and ``nan`` in any float option (TOML can write them; no option means them)."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)


class Component:
    """A named, configurable piece a plan can select with ``use = "<name>"``.

    Subclasses set ``name`` and, when they take options, ``Options`` (a pydantic model).
    The core validates the plan's section against ``Options`` and passes the result to
    ``__init__``. Import heavy libraries (torch, transformers) inside methods, never at
    module level, so listing and validating plugins stays fast.
    """

    name: ClassVar[str] = ""
    Options: ClassVar[type[BaseModel]] = Options

    def __init__(self, options: BaseModel | None = None):
        self.options = options if options is not None else self.Options()

    def check(self, plan: Any) -> list[str]:
        """Cross-checks against the whole plan, before anything heavy runs: problems as ``"key: message"``
        relative to this component's section."""
        return []

    def inputs(self) -> list[Any]:
        """Data sources: the files this source reads, for the run manifest's sha256 list."""
        return []


class PlanSection:
    """A top-level plan table a plugin owns (``[sweep]``, ``[distributed]``, ``[track]``), registered through
    ``register_plan_sections`` (docs/writing-plugins.md). ``name`` is the table's name; ``Options`` its keys,
    validated as a component's options are, unless the class reads its table itself with a classmethod
    ``parse(table, problem)``, or ``parse(table, problem, select)`` to select components: ``select(kind,
    name, key, options)`` returns a :class:`ftcore.plan.Selected` or ``None``, the problem reported.
    ``fingerprint = False`` leaves the table out of the run's fingerprint. Every installed section is
    part of every plan: ``plan.sections[name]``, and ``plan.<name>``, its :attr:`value`."""

    name: ClassVar[str] = ""
    Options: ClassVar[type[BaseModel]] = Options
    fingerprint: ClassVar[bool] = True

    def __init__(self, options: Any = None):
        self.options = options  # the table, validated; None where the plan does not write it

    @property
    def value(self) -> Any:
        """What ``plan.<name>`` gives: the options (``None`` without the table), unless overridden."""
        return self.options

    def check(self, plan: Any) -> list[str]:
        """Cross-checks against the whole plan, once the rest of it is valid: problems as
        ``"key: message"`` relative to the table (``ftcore validate`` prints ``<name>.<key>``)."""
        return []

    def components(self) -> list[Any]:
        """The components the table selects: their ``check(plan)`` runs with the other components', and
        ``ftcore run`` registers the trackers among them as plugins for the length of the run."""
        return []

    def launch(self, plan: Any, argv: list[str]) -> int | None:
        """Called by ``ftcore run`` before the run: an exit status when this section ran the plan
        another way (in several processes), or ``None`` to run it in this process."""
        return None

    def on_main(self, fn: Any) -> Any:
        """Run ``fn`` once for all the processes of this run and return its result in each (the runner
        decides the run folder so). One process: ``fn()``."""
        return fn()


@dataclass(frozen=True)
class Kind:
    id: str  # used in messages: "unknown trainer 'x'"
    hook: str  # the registry hook that registers it
    methods: tuple[str, ...]  # what every component of this kind must have
    title: str  # plural heading for `ftcore plugins`


KINDS: dict[str, Kind] = {
    k.id: k
    for k in (
        Kind("model loader", "register_model_loaders", ("load",), "Model loaders"),
        Kind("data source", "register_data_sources", ("load",), "Data sources"),
        Kind("chat template", "register_chat_templates", ("render",), "Chat templates"),
        Kind("adapter", "register_adapters", ("apply", "save", "restore", "merge"), "Adapters"),
        Kind("quantizer", "register_quantizers", ("load_kwargs", "prepare"), "Quantizers"),
        Kind("trainer", "register_trainers", ("train",), "Trainers"),
        Kind("evaluator", "register_evaluators", ("evaluate",), "Evaluators"),
        Kind("exporter", "register_exporters", ("export",), "Exporters"),
        Kind("reward function", "register_reward_functions", ("score",), "Reward functions"),
        Kind("tracker", "register_trackers", ("ftcore_log",), "Trackers"),
    )
}
