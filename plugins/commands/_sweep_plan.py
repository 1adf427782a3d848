"""A plan's ``[sweep]`` table: the hyperparameter search ``ftcore sweep`` runs with Optuna.

::

    [sweep]
    sampler = "tpe"            # tpe, random, grid or cmaes
    trials = 12
    metric = "perplexity"      # "<evaluation>/<metric>", "<evaluation>", or "eval_loss"
    direction = "minimize"
    pruner = "median"          # median, hyperband or none

    [sweep.space]
    "stage.sft.learning_rate" = { low = 5e-5, high = 5e-4, log = true }
    "stage.sft.adapter.r" = { choices = [8, 16, 32] }

A space key is a dotted path into the plan: ``stage.<name>.<option>`` (also ``.adapter.<option>``),
``evaluate.<name>.<option>``, ``export.<name>.<option>``, ``data.<name>.<option>``,
``reward.<name>.<option>``, ``model.<option>``, ``template.<option>``, ``quantizer.<option>``,
``adapter.<option>`` and ``run.seed``. This module reads and checks the table and fills values into
a plan; it imports neither Optuna nor torch, so ``ftcore validate`` stays light. The sweep command owns
the table: it registers :class:`SweepSection` through ``register_plan_sections``.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, replace
from typing import Any

from ftcore.component import PlanSection
from ftcore.errors import did_you_mean, unknown_choice

SAMPLERS = ("tpe", "random", "grid", "cmaes")
PRUNERS = ("median", "hyperband", "none")
DIRECTIONS = ("minimize", "maximize")
KEYS = {"sampler": str, "trials": int, "metric": str, "direction": str, "pruner": str, "seed": int,
        "storage": str, "startup_trials": int, "prune_startup_trials": int, "prune_warmup_steps": int,
        "share_stages": bool, "study": str, "space": dict}
RANGE_KEYS = ("low", "high", "log", "step", "choices")
EVAL_LOSS = "eval_loss"
# Keys a trial sets itself: a value from the search would move its run folder.
RESERVED = {("run", "name"), ("run", "output_dir")}
_SECTIONS = ("model", "template", "quantizer", "adapter")
_NAMED = {"stage": "stage", "evaluate": "evaluate", "export": "export"}  # arrays of tables, addressed by name


@dataclass(frozen=True)
class Param:
    """One dimension of the search space."""

    path: str  # as the plan writes it: "stage.sft.learning_rate"
    keys: tuple[Any, ...]  # where it goes in the plan's tables: ("stage", 1, "learning_rate")
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    step: float | int | None = None
    choices: tuple[Any, ...] | None = None

    @property
    def kind(self) -> str:
        """``categorical``, ``int`` (both bounds integers) or ``float``."""
        if self.choices is not None:
            return "categorical"
        integral = all(isinstance(v, int) for v in (self.low, self.high)) and (self.step is None or isinstance(self.step, int))
        return "int" if integral else "float"

    def grid(self) -> list[Any]:
        """The values a grid search tries: the choices, or ``low, low + step, ..., high``."""
        if self.choices is not None:
            return list(self.choices)
        count = int(round((self.high - self.low) / self.step)) + 1
        return [self.low + i * self.step for i in range(count) if self.low + i * self.step <= self.high + 1e-12]

    def extremes(self) -> list[Any]:
        """The values that validation tries in the plan: each choice, or both bounds."""
        return list(self.choices) if self.choices is not None else [self.low, self.high]

    @property
    def stage(self) -> int | None:
        return self.keys[1] if self.keys[0] == "stage" else None


@dataclass(frozen=True)
class Sweep:
    sampler: str
    trials: int
    metric: str
    direction: str
    pruner: str
    space: tuple[Param, ...]
    seed: int | None = None
    storage: str | None = None  # an Optuna RDB URL; default: SQLite in the sweep folder
    startup_trials: int | None = None  # random trials before TPE models the space; default min(10, trials // 3)
    prune_startup_trials: int = 3  # finished trials before any is pruned
    prune_warmup_steps: int = 0  # steps of a trial before it may be pruned
    share_stages: bool = True  # train the stages before the first searched one once; keep models in memory
    study: str | None = None  # the Optuna study's name; default: the plan's run name

    def first_searched_stage(self, stages: int) -> int:
        """Index of the first stage a trial's values can change; those before it are the same in every
        trial. A value outside the stages (the model, the template, the data, ...) changes them all."""
        found = [p.stage if p.stage is not None else 0 for p in self.space if p.keys[0] not in ("evaluate", "export")]
        return min(found, default=stages)

    def pruned_stage(self, stages: int) -> int:
        """Index of the stage whose eval loss is the pruning signal: the last one the search changes."""
        touched = [p.stage for p in self.space if p.stage is not None]
        return max(touched) if touched else stages - 1


def strip(raw: dict[str, Any]) -> dict[str, Any]:
    """The plan without its ``[sweep]`` table: what each trial runs."""
    return {k: v for k, v in raw.items() if k != "sweep"}


def locate(raw: dict[str, Any], path: str) -> tuple[tuple[Any, ...] | None, str]:
    """Where dotted ``path`` points in the plan: ``(keys, "")``, or ``(None, why not)``."""
    head, _, rest = path.partition(".")
    if not rest:
        return None, "must be a dotted path to an option, e.g. stage.<name>.learning_rate"
    if head in _NAMED:
        sections = raw.get(head, [])
        sections = [sections] if isinstance(sections, dict) else sections if isinstance(sections, list) else []
        names = {}
        for i, section in enumerate(sections):
            default = f"{i}-{section.get('trainer', 'stage')}" if head == "stage" else section.get("use")
            names[str(section.get("name") or default)] = i
        # Names may hold dots: the longest name the path starts with.
        for name in sorted(names, key=len, reverse=True):
            if rest.startswith(name + "."):
                return (head, names[name], *rest[len(name) + 1:].split(".")), ""
        known = ", ".join(names) or "none"
        return None, f"no {head} named {rest.split('.')[0]!r}; {head}s: {known}"
    if head in ("data", "reward"):
        name, _, option = rest.partition(".")
        table = raw.get(head) if isinstance(raw.get(head), dict) else {}
        if name not in table:
            return None, f"no [{head}.{name}] in the plan; defined: {', '.join(table) or 'none'}"
        if not option:
            return None, f"name an option of [{head}.{name}], e.g. {head}.{name}.<option>"
        return (head, name, *option.split(".")), ""
    if head == "adapter" and "adapter" not in raw:
        own = [i for i, s in enumerate(raw.get("stage", []) if isinstance(raw.get("stage"), list) else [])
               if isinstance(s, dict) and s.get("adapter") not in (None, "full", "freeze")]
        if len(own) == 1:
            return ("stage", own[0], "adapter", *rest.split(".")), ""
        return None, ("the plan has no top-level [adapter] and " + ("no stage has its own adapter" if not own else
                      f"{len(own)} stages have their own; write stage.<name>.adapter.{rest}"))
    if head in _SECTIONS or head == "run":
        keys = (head, *rest.split("."))
        if keys in RESERVED:
            return None, f"{path} places the trials' run folders; the sweep sets it"
        if head == "run" and rest != "seed":
            return None, "of [run], only run.seed can be searched"
        return keys, ""
    tops = ", ".join([*_NAMED, "data", "reward", *_SECTIONS, "run"])
    hint = did_you_mean(head, tops.split(", "))
    return None, f"unknown plan section {head!r}" + (f"{hint} Paths start with: " if hint else "; paths start with: ") + tops


def apply(raw: dict[str, Any], values: dict[tuple[Any, ...], Any]) -> dict[str, Any]:
    """A copy of plan ``raw`` with each ``keys -> value`` set. A component written by name alone
    (``adapter = "lora"``) becomes a table; a stage without its own adapter gets the plan's default."""
    out = copy.deepcopy(raw)
    for keys, value in values.items():
        node: Any = out
        for key in keys[:-1]:
            child = node[key] if isinstance(node, list) else node.get(key)
            if child is None and keys[0] == "stage" and key == "adapter":
                child = copy.deepcopy(out.get("adapter", "full"))
            if child is None:
                child = {}
            if isinstance(child, str):  # shorthand: the component's name
                child = {"use": child}
            node[key] = child
            node = child
        node[keys[-1]] = value
    return out


def read(section: Any, problem: Any) -> Sweep | None:
    """Read ``[sweep]``, reporting its shape's problems through ``problem(key, message)``. Values are
    checked against the plan's own options by :func:`check_values`."""
    if not isinstance(section, dict):
        problem("sweep", "must be a table ([sweep])")
        return None
    ok = True
    for key, value in section.items():
        if key not in KEYS:
            problem(f"sweep.{key}", _unknown_key(key, KEYS))
            ok = False
        elif not isinstance(value, KEYS[key]) or (KEYS[key] is int and isinstance(value, bool)):
            problem(f"sweep.{key}", f"must be {'a table' if KEYS[key] is dict else KEYS[key].__name__}, got {value!r}")
            ok = False
    for key, valid in (("sampler", SAMPLERS), ("pruner", PRUNERS), ("direction", DIRECTIONS)):
        value = section.get(key)
        if isinstance(value, str) and value not in valid:
            problem(f"sweep.{key}", unknown_choice(key, value, valid))
            ok = False
    for key, low, high in (("trials", 1, 100_000), ("startup_trials", 1, 100_000), ("prune_startup_trials", 0, 100_000),
                           ("prune_warmup_steps", 0, 10**9)):
        value = section.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and not low <= value <= high:
            problem(f"sweep.{key}", f"must be between {low} and {high}, got {value}")
            ok = False
    if "metric" not in section:
        problem("sweep.metric", "missing required key: the metric to optimise, e.g. \"perplexity\" or \"eval_loss\"")
        ok = False
    if "direction" not in section:
        problem("sweep.direction", "missing required key: \"minimize\" or \"maximize\"")
        ok = False
    space = section.get("space")
    if not isinstance(space, dict) or not space:
        problem("sweep.space", "missing or empty: add [sweep.space] with one entry per option to search")
        return None
    params = []
    for path, spec in space.items():
        param = _param(path, spec, lambda message, _p=path: problem(f'sweep.space."{_p}"', message))
        ok = ok and param is not None
        if param is not None:
            params.append(param)
    if not ok:
        return None
    sampler = section.get("sampler", "tpe")
    if sampler == "grid":
        for p in params:
            if p.choices is None and p.step is None:
                problem(f'sweep.space."{p.path}"', "the grid sampler needs choices, or low and high with a step")
                return None
    trials = section.get("trials")
    if trials is None:
        if sampler != "grid":
            problem("sweep.trials", "missing required key: how many trials to run")
            return None
        trials = len(list(itertools.product(*(p.grid() for p in params))))
    return Sweep(sampler, trials, section["metric"], section["direction"], section.get("pruner", "median"),
                 tuple(params), section.get("seed"), section.get("storage"), section.get("startup_trials"),
                 section.get("prune_startup_trials", 3), section.get("prune_warmup_steps", 0),
                 section.get("share_stages", True), section.get("study"))


def _param(path: str, spec: Any, problem: Any) -> Param | None:
    if not isinstance(spec, dict):
        problem("must be a table: { low = ..., high = ... } or { choices = [...] }")
        return None
    unknown = [k for k in spec if k not in RANGE_KEYS]
    if unknown:
        problem(_unknown_key(unknown[0], RANGE_KEYS))
        return None
    if "choices" in spec:
        choices = spec["choices"]
        if set(spec) != {"choices"}:
            problem("choices cannot be combined with low, high, log or step")
            return None
        if not isinstance(choices, list) or not choices or \
                not all(isinstance(c, (str, int, float, bool)) for c in choices):
            problem("choices must be a non-empty array of strings, numbers or booleans")
            return None
        if len(set(map(repr, choices))) < len(choices):
            problem("choices has a value twice")
            return None
        return Param(path, (), choices=tuple(choices))
    low, high, log, step = spec.get("low"), spec.get("high"), spec.get("log", False), spec.get("step")
    for name, value in (("low", low), ("high", high), ("step", step)):
        if value is None and name != "step":
            problem(f"missing {name}: a range needs low and high (or use choices)")
            return None
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            problem(f"{name} must be a number, got {value!r}")
            return None
    if not isinstance(log, bool):
        problem(f"log must be true or false, got {log!r}")
        return None
    if not low < high:
        problem(f"low must be below high, got low {low!r} and high {high!r}")
        return None
    if log and low <= 0:
        problem(f"a log range needs low above 0, got {low!r}")
        return None
    if log and step is not None:
        problem("log and step cannot be combined (Optuna samples a log range continuously)")
        return None
    if step is not None and step <= 0:
        problem(f"step must be above 0, got {step!r}")
        return None
    return Param(path, (), low=low, high=high, log=log, step=step)


class SweepSection(PlanSection):
    """[sweep]: the hyperparameter search of ``ftcore sweep``; ``ftcore run`` ignores it."""

    name = "sweep"
    fingerprint = False  # a run does not read it

    @classmethod
    def parse(cls, table: Any, problem: Any) -> Sweep | None:
        return read(table, problem)

    def check(self, plan: Any) -> list[str]:
        self.options, problems = check(self.options, plan)
        return problems


def check(sweep: Sweep | None, plan: Any) -> tuple[Sweep | None, list[str]]:
    """Check ``[sweep]`` (as :func:`read` read it) against the rest of its plan, which is valid: every
    path exists, each extreme value of each range passes the option's own validation, and the metric
    names an evaluation that runs after training (or a stage with eval data). Returns the sweep with its
    paths located, and the problems, each ``key: message`` in the table."""
    from ftcore.errors import PlanError
    from ftcore.plan import check_plan

    problems: list[str] = []

    def problem(key: str, message: str) -> None:
        problems.append(f"{key}: {message}" if key else message)

    if sweep is None:
        return None, problems
    base, shown = strip(plan.raw), plan.shown or str(plan.path)
    located = []
    for p in sweep.space:
        keys, why = locate(base, p.path)
        if keys is None:
            problem(f'space."{p.path}"', why)
            continue
        located.append(replace(p, keys=keys))
    if problems:
        return None, problems
    sweep = replace(sweep, space=tuple(located))
    for p in sweep.space:
        for value in p.extremes():
            try:
                check_plan(apply(base, {p.keys: value}), plan.path, plan.registry, shown=shown)
            except PlanError as exc:
                for line in exc.problems:
                    message = line[len(shown) + 2:] if line.startswith(f"{shown}: ") else line
                    unknown = "unknown key" in message  # the path itself, whatever the value
                    problem(f'space."{p.path}"', message if unknown else f"{value!r} fails the plan's check: "
                                                                          f"{message}")
                break
    stages = plan.stages
    if sweep.metric == EVAL_LOSS or sweep.pruner != "none":
        stage = stages[sweep.pruned_stage(len(stages))] if stages else None
        if stage is not None and stage.eval_data is None:
            what = "metric eval_loss" if sweep.metric == EVAL_LOSS else f"pruner {sweep.pruner!r}"
            problem("metric" if sweep.metric == EVAL_LOSS else "pruner",
                    f"{what} reads stage {stage.name!r}'s eval loss, and it has no eval_data; set eval_data "
                    f"(and eval_steps) on it" + ("" if sweep.metric == EVAL_LOSS else ", or pruner = \"none\""))
    if sweep.metric != EVAL_LOSS:
        evaluation = sweep.metric.split("/")[0]
        found = next((e for e in plan.evaluations if e.name == evaluation), None)
        if found is None:
            names = [e.name for e in plan.evaluations]
            hint = did_you_mean(evaluation, names)
            problem("metric", f"no evaluation named {evaluation!r}" + (f"{hint} Evaluations: " if hint else
                                    "; evaluations: ") + f"{', '.join(names) or 'none'} (or use \"eval_loss\")")
        elif "after" not in found.when:
            problem("metric", f"evaluation {evaluation!r} does not run after training (when = "
                                    f"{list(found.when)}); add \"after\" to its when")
    if sweep.sampler == "cmaes" and any(p.kind == "categorical" for p in sweep.space):
        problem("sampler", "cmaes searches numeric ranges only; its categorical parameters would be sampled "
                                 "at random: use \"tpe\" for choices")
    if getattr(plan.sections.get("distributed"), "value", None) is not None and plan.distributed.wanted:
        problem("", "a sweep runs its trials in one process; remove [distributed], or run several "
                         "`ftcore sweep` processes on one storage (docs/sweeps.md)")
    return (sweep if not problems else None), problems


def _unknown_key(key: str, valid: Any) -> str:
    hint = did_you_mean(key, valid)
    return f"unknown key {key!r}" + (f"{hint} Valid keys: " if hint else "; valid keys: ") + ", ".join(sorted(valid))


