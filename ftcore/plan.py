"""The typed plan: a TOML file, checked whole against the installed components. Every problem is
collected and reported at once, one line each, as ``<file>: <key path>: <what is wrong>``."""

from __future__ import annotations

import hashlib
import inspect
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from .errors import PlanError, did_you_mean, one_line, unknown_choice
from .registry import Registration, Registry
from .types import file_in_the_way

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# The core's tables; plugins add theirs through register_plan_sections.
TOP_LEVEL = ("run", "model", "quantizer", "template", "adapter", "data", "reward", "stage", "evaluate", "export")
RUN_KEYS = {"name": str, "seed": int, "output_dir": str}
SEED_MAX = 2**32 - 1  # numpy's seeds, which every trainer sets with torch's, are 0 ... 2**32 - 1
STAGE_KEYS = ("name", "trainer", "data", "eval_data", "adapter")
EVALUATE_KEYS = ("name", "use", "data", "when")
EXPORT_KEYS = ("name", "use", "path")
PHASES = ("before", "after", "both")  # reserved: a `when` may also name stages
DEFAULTS = {"quantizer": "none", "template": "native", "adapter": "full"}
# "token", "hf_token", "api_key", ... but not "max_new_tokens".
_SECRET = re.compile(r"(^|[_-])(token|secret|password|passwd|api[_-]?key|credentials?)$", re.I)
_SECRET_VALUE = re.compile(r"\b(hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_\-]{20,}|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_\w{20,}"
                           r"|xox[abprs]-[A-Za-z0-9\-]{10,})")
_URL_PASSWORD = re.compile(r"(\b[a-z][a-z0-9+.\-]*://[^:/@\s]+):[^@\s]+@", re.I)  # "postgresql://user:pw@host"
_FOLDER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_KEY = r'(?:[A-Za-z_]\w*|"[^"]*")(?:\[\d+\])*'  # a key, bare or quoted, and its indices
_SUBKEY = re.compile(rf"^({_KEY}(?:\.{_KEY})*): ")  # "tokenizer_data[0]: ...", 'space."stage.sft.lr": ...' 


def phase_order(stages: list[str]) -> list[str]:
    """Evaluation phases in run order: before training, right after each stage but the last, after."""
    return ["before", *stages[:-1], "after"]


@dataclass
class Selected:
    """A component the plan selected, with its validated options."""

    key: str  # key path in the plan, for messages: "stage[0]", "data.chat"
    reg: Registration
    options: BaseModel
    written: str | None = None  # the name as the plan wrote it: "acme-dup:sft" where name is "sft"

    def create(self) -> Any:
        return self.reg.cls(self.options)

    @property
    def name(self) -> str:
        return self.reg.name

    @property
    def shown(self) -> str:
        """The name as the plan wrote it, for what a run prints."""
        return self.written or self.reg.name


@dataclass
class Stage:
    index: int
    name: str
    trainer: Selected
    data: str
    eval_data: str | None
    adapter: Selected

    @property
    def trains_policy(self) -> bool:
        """False for a stage that trains a separate model (a reward model) and leaves the policy as it was."""
        return getattr(self.trainer.reg.cls, "trains_policy", True)


@dataclass
class Evaluation:
    name: str
    evaluator: Selected
    data: str | None
    when: tuple[str, ...]  # phases, in run order: "before", stage names (right after them), "after"


@dataclass
class Export:
    name: str
    exporter: Selected
    path: Path | None


@dataclass
class Plan:
    path: Path
    raw: dict[str, Any]
    run_name: str
    seed: int
    output_dir: Path
    model: Selected
    quantizer: Selected
    template: Selected
    data: dict[str, Selected]
    stages: list[Stage]
    evaluations: list[Evaluation]
    exports: list[Export]
    rewards: dict[str, Selected]
    shown: str = ""  # the plan file as the user named it, for messages
    sections: dict[str, Any] = field(default_factory=dict)  # name -> PlanSection: the tables plugins own
    registry: Registry | None = None  # what the plan was checked against

    def __getattr__(self, name: str) -> Any:
        """``plan.<table>``: the value of a plugin-owned table (``plan.sweep``, ``plan.distributed``)."""
        sections = self.__dict__.get("sections") or {}
        if name in sections:
            return sections[name].value
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def problem(self, key: str, message: str) -> str:
        """A problem with this plan, in the form validation reports them: ``<file>: <key>: <message>``."""
        return f"{self.shown or self.path}: {key}: {message}"

    @property
    def trackers(self) -> list[Selected]:
        """The trackers the plugins' tables select (``[track]``): the runner registers them for the run."""
        return [c for s in self.sections.values() for c in s.components() if c.reg.kind == "tracker"]

    @property
    def base_dir(self) -> Path:
        return self.path.parent

    @property
    def run_dir(self) -> Path:
        return self.output_dir / self.run_name

    def redacted(self) -> dict[str, Any]:
        """The plan as written, with anything that looks like a secret replaced."""
        return redact(self.raw)

    def fingerprint(self) -> str:
        """Identity of the plan's content, ignoring formatting, comments and the plugins' tables whose
        section says ``fingerprint = False``."""
        content = {k: v for k, v in self.raw.items() if k not in self.sections or self.sections[k].fingerprint}
        blob = json.dumps(content, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()


def read_toml(path: Path, shown: str) -> dict[str, Any]:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise PlanError([f"{shown}: no such plan file"]) from None
    except IsADirectoryError:
        raise PlanError([f"{shown}: is a folder, not a plan file"]) from None
    except OSError as exc:
        raise PlanError([f"{shown}: cannot read plan: {exc.strerror}"]) from None
    try:
        text = data.decode("utf-8-sig")  # a BOM, as some Windows editors write, is not part of the TOML
    except UnicodeDecodeError as exc:
        bom = 3 if data.startswith(b"\xef\xbb\xbf") else 0
        start = exc.start + bom
        line = data.count(b"\n", 0, start) + 1
        line_start = max(data.rfind(b"\n", 0, start) + 1, bom)
        column = len(data[line_start:start].decode("utf-8")) + 1  # characters: all valid before the bad byte
        raise PlanError([f"{shown}:{line}: not UTF-8 text at column {column} (byte {data[start]:#04x}); "
                         f"save the plan as UTF-8"]) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        # Python < 3.14 has no exc.lineno; the position is at the end of the message.
        msg = str(exc)
        where = re.search(r"\s*\(at line (\d+), column (\d+)\)$", msg)
        line = int(where.group(1)) if where else None
        if where:
            msg = f"{msg[: where.start()]} (column {where.group(2)})"
        where = f"{shown}:{line}" if line else shown
        raise PlanError([f"{where}: invalid TOML: {msg}"]) from None


def load_plan(path: str | Path, registry: Registry, overrides: dict[str, dict[str, Any]] | None = None) -> Plan:
    """Read and check a plan. Raises :class:`PlanError` listing every problem. ``overrides`` sets keys
    of plugin-owned tables, by table (``ftcore run``'s flags set ``[distributed]``'s)."""
    shown = str(path)
    path = Path(path).expanduser().resolve()
    return check_plan(read_toml(path, shown), path, registry, shown=shown, overrides=overrides)


def check_plan(raw: dict[str, Any], path: str | Path, registry: Registry, *, shown: str | None = None,
               overrides: dict[str, dict[str, Any]] | None = None) -> Plan:
    """Check a plan already read into a dict (a run manifest's copy, a plan built in code), as if it were
    the file ``path``: relative paths resolve against its folder and problems are prefixed ``shown``
    (default: ``path``). Raises :class:`PlanError` listing every problem."""
    path = Path(path).expanduser().resolve()
    checker = _Checker(shown or str(path), path.parent, registry)
    plan = checker.check(raw, path, overrides or {})
    if checker.problems:
        raise PlanError(checker.problems)
    assert plan is not None
    return plan


class _Checker:
    def __init__(self, shown: str, base_dir: Path, registry: Registry):
        self.shown = shown
        self.base_dir = base_dir
        self.registry = registry
        self.problems: list[str] = []
        self.refs: dict[str, Any] = {}  # what options typed StageRef and RewardRef may name, while checked

    def problem(self, key: str, message: str) -> None:
        line = f"{self.shown}: {key}: {message}" if key else f"{self.shown}: {message}"
        if line not in self.problems:  # the top-level [adapter]'s check, once for all the stages it serves
            self.problems.append(line)

    # -- structure ---------------------------------------------------------------------
    def table(self, raw: dict, key: str, required: bool = False) -> dict | None:
        value = raw.get(key)
        if value is None:
            if required:
                self.problem(key, f"missing required table [{key}]")
            return None
        if not isinstance(value, dict):
            self.problem(key, f"must be a table ([{key}]), got {type_name(value)}")
            return None
        return value

    def tables(self, raw: dict, key: str) -> list[dict]:
        value = raw.get(key, [])
        if isinstance(value, dict):
            value = [value]  # [export] written once instead of [[export]]
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            self.problem(key, f"must be an array of tables ([[{key}]]), got {type_name(value)}")
            return []
        return value

    def string(self, section: dict, key: str, path: str, required: bool = False) -> str | None:
        value = section.get(key)
        if value is None:
            if required:
                self.problem(path, "missing required key")
            return None
        if not isinstance(value, str) or not value:
            self.problem(path, f"must be a non-empty string, got {type_name(value)}")
            return None
        return value

    # -- components --------------------------------------------------------------------
    def component(self, kind: str, key: str, section: dict | str | None, core_keys: tuple = ("use",),
                  name_key: str = "use", default: str | None = None) -> Selected | None:
        if isinstance(section, str):  # shorthand: adapter = "full"
            section = {name_key: section}
        if section is not None and not isinstance(section, dict):
            self.problem(key, f"must be a table or a name, got {type_name(section)}")
            return None
        section = dict(section or {})
        if name_key not in section and default is not None:
            section[name_key] = default
        name = self.string(section, name_key, f"{key}.{name_key}", required=True)
        if name is None:
            return None
        return self.select(kind, name, key, {k: v for k, v in section.items() if k not in core_keys}, core_keys,
                           name_key)

    def select(self, kind: str, name: str, key: str, raw: dict, core_keys: tuple = (),
               name_key: str | None = None) -> Selected | None:
        """The component ``name`` of ``kind``, its options ``raw`` checked, as the plan selects it at ``key``;
        None once the problem is reported (an unknown name at ``key.<name_key>``, or at ``key``)."""
        try:
            reg = self.registry.resolve(kind, name)
        except LookupError as exc:
            self.problem(f"{key}.{name_key}" if name_key else key, str(exc))
            return None
        options = self.options(reg, key, raw, core_keys)
        return None if options is None else Selected(key, reg, options, name)

    def options(self, reg: Registration, key: str, raw: dict, core_keys: tuple) -> BaseModel | None:
        fields = {info.alias or name for name, info in reg.cls.Options.model_fields.items()}
        unknown = [k for k in raw if k not in fields]
        for k in unknown:
            self.problem(f"{key}.{k}", _unknown_key(f"unknown key for {reg.kind} '{reg.name}'", k,
                                                    fields | set(core_keys)))
        return None if unknown else self.validated(reg.cls.Options, key, raw, reg)

    def validated(self, model: type[BaseModel], key: str, raw: dict, reg: Registration | None) -> BaseModel | None:
        try:
            # Strict, as TOML is typed: "8" is not an int, "yes" not a bool. JSON mode still takes
            # strings for paths; TOML dates (which JSON lacks) arrive as strings and fail as such.
            return model.model_validate_json(json.dumps(raw, default=str), strict=True,
                                             context={"base_dir": self.base_dir, **self.refs})
        except ValidationError as exc:
            by_key: dict[str, list[str]] = {}
            for err in exc.errors():
                by_key.setdefault(key + _loc(err["loc"]), []).append(_pydantic_message(err))
            for path, messages in by_key.items():  # a union reports once per member: join them
                self.problem(path, " or ".join(messages))
            return None
        except Exception as exc:  # a validator that crashed: the plugin's bug, not the plan's
            if reg is None:
                raise
            self.problem(key, f"{reg.kind} '{reg.name}' from {reg.who()} failed validating its options: "
                              f"{one_line(exc)}")
            return None

    # -- the plan ----------------------------------------------------------------------
    def check(self, raw: dict, path: Path, overrides: dict[str, dict[str, Any]]) -> Plan | None:
        owned = self.registry.sections
        for k in raw:
            if k not in TOP_LEVEL and k not in owned:
                self.problem(k, _unknown_key("unknown top-level key", k, [*TOP_LEVEL, *owned]))
        sections = self.sections(raw, overrides)
        for k in set(overrides) - set(owned):
            self.problem(k, f"no installed plugin owns the table [{k}]")

        run = self.table(raw, "run") or {}
        for k, v in run.items():
            if k not in RUN_KEYS:
                self.problem(f"run.{k}", _unknown_key("unknown key", k, RUN_KEYS))
            elif not isinstance(v, RUN_KEYS[k]) or isinstance(v, bool):
                self.problem(f"run.{k}", f"must be {RUN_KEYS[k].__name__}, got {type_name(v)}")
            elif k == "seed" and not 0 <= v <= SEED_MAX:
                self.problem("run.seed", f"must be between 0 and {SEED_MAX} (2**32 - 1), got {v}")
        run_name = run.get("name") if isinstance(run.get("name"), str) else path.stem
        self.folder_name(run_name, "run.name")
        seed = run.get("seed", 42)
        seed = seed if isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed <= SEED_MAX else 42
        output_dir = Path(run["output_dir"]) if isinstance(run.get("output_dir"), str) else Path("runs")
        try:
            output_dir = (self.base_dir / output_dir.expanduser()).resolve()
        except RuntimeError as exc:  # "~user/..." for a user that does not exist
            self.problem("run.output_dir", f"cannot expand {str(output_dir)!r}: {exc}")
        else:
            blocker = file_in_the_way(output_dir / run_name)
            if blocker is not None:
                self.problem("run.name" if blocker == output_dir / run_name else "run.output_dir",
                             f"{blocker} is a file, not a folder; the run is written to {output_dir / run_name}/")

        model_section = self.table(raw, "model", required=True)
        model = self.component("model loader", "model", model_section) if model_section is not None else None
        quantizer = self.component("quantizer", "quantizer", raw.get("quantizer"), default=DEFAULTS["quantizer"])
        template = self.component("chat template", "template", raw.get("template"), default=DEFAULTS["template"])
        default_adapter = raw.get("adapter", DEFAULTS["adapter"])
        if not isinstance(default_adapter, (str, dict)):
            self.problem("adapter", f"must be a table or a name, got {type_name(default_adapter)}")
            default_adapter = DEFAULTS["adapter"]
        # The top-level [adapter], checked once where it is written: its problems are "adapter.<key>",
        # not one line per stage that uses it.
        shared_adapter = self.component("adapter", "adapter", default_adapter, default=DEFAULTS["adapter"]) \
            if "adapter" in raw else None

        data, data_names = self.named(raw, "data", "data source")
        data_readable = isinstance(raw.get("data", {}), dict)  # else references to it say nothing new
        rewards, reward_names = self.named(raw, "reward", "reward function")  # a reference to any name written holds

        def data_ref(section: dict, key: str, path: str, required: bool) -> str | None:
            """``name`` (its train split) or ``name:split``, e.g. ``chat:validation``."""
            ref = self.string(section, key, path, required)
            if ref is None:
                return None
            name, _, split = ref.partition(":")
            if name not in data_names:
                if data_readable:
                    self.problem(path, unknown_choice("data", name, data_names, none="none defined")
                                 .replace("unknown data", "undefined data") + (" (define it as [data.%s])" % name))
            elif split and name in data:
                splits = _splits(data[name])
                if split not in splits:
                    self.problem(path, f"data '{name}' has no split '{split}'; it has: {', '.join(splits)}"
                                       + ("; set validation = 0.1 (or a row count) in [data.%s] to hold some out"
                                          % name if split == "validation" else ""))
            return ref

        stages: list[Stage] = []
        seen: set[str] = set()
        if isinstance(raw.get("stage"), dict):  # `[stage]` (or `[stage.sft]`): one table, not an array of them
            self.problem("stage", "must be an array of tables: write each stage as [[stage]] (double brackets), "
                                  "not [stage]")
        for i, section in enumerate(self.tables(raw, "stage") if not isinstance(raw.get("stage"), dict) else []):
            key = f"stage[{i}]"
            self.refs = {"stages": [s.name for s in stages], "rewards": reward_names}
            trainer = self.component("trainer", key, section, core_keys=STAGE_KEYS, name_key="trainer")
            self.refs = {}
            name = section.get("name") or f"{i}-{trainer.name if trainer else 'stage'}"
            if name in PHASES:
                self.problem(f"{key}.name", f"{name!r} is reserved for evaluation phases; name the stage otherwise")
            self.unique_name(name, f"{key}.name", "stage", seen)
            ref = data_ref(section, "data", f"{key}.data", required=True)
            eval_ref = data_ref(section, "eval_data", f"{key}.eval_data", required=False)
            if "adapter" in section or shared_adapter is None and "adapter" not in raw:
                adapter = self.component("adapter", f"{key}.adapter", section.get("adapter", default_adapter),
                                         default=DEFAULTS["adapter"])
            else:  # the top-level [adapter]: each stage its own copy (a component may look its stage up by it)
                adapter = shared_adapter and Selected("adapter", shared_adapter.reg,
                                                      shared_adapter.options.model_copy(deep=True),
                                                      shared_adapter.written)
            if trainer and adapter and ref:
                stages.append(Stage(i, str(name), trainer, ref, eval_ref, adapter))

        evaluations: list[Evaluation] = []
        seen = set()
        for i, section in enumerate(self.tables(raw, "evaluate")):
            key = f"evaluate[{i}]"
            ev = self.component("evaluator", key, section, core_keys=EVALUATE_KEYS)
            ref = data_ref(section, "data", f"{key}.data", required=False)
            when = self.phases(section.get("when", "both"), f"{key}.when", [s.name for s in stages])
            name = section.get("name") or (ev.name if ev else None)
            if name is not None and self.unique_name(name, f"{key}.name", "evaluation", seen) and ev:
                evaluations.append(Evaluation(name, ev, ref, when))

        exports: list[Export] = []
        seen = set()
        for i, section in enumerate(self.tables(raw, "export")):
            key = f"export[{i}]"
            ex = self.component("exporter", key, section, core_keys=EXPORT_KEYS)
            out = section.get("path")
            if out is not None and not isinstance(out, str):
                self.problem(f"{key}.path", f"must be a string, got {type_name(out)}")
                out = None
            elif out is not None and (blocker := file_in_the_way((self.base_dir / out).resolve().parent)):
                self.problem(f"{key}.path", f"cannot write {out}: {blocker} is a file, not a folder")
                out = None
            name = section.get("name") or (ex.name if ex else None)
            if name is not None and self.unique_name(name, f"{key}.name", "export", seen) and ex:
                exports.append(Export(name, ex, (self.base_dir / out).resolve() if out else None))

        if self.problems or model is None or quantizer is None or template is None:
            return None
        plan = Plan(path, raw, run_name, seed, output_dir, model, quantizer, template, data,
                    stages, evaluations, exports, rewards, self.shown, sections, self.registry)
        # Cross-checks a component makes against the whole plan (cheap: nothing is loaded).
        for sel in [model, quantizer, template, *data.values(), *(s.trainer for s in stages),
                    *(s.adapter for s in stages), *(e.evaluator for e in evaluations),
                    *(e.exporter for e in exports), *rewards.values(),
                    *(c for section in sections.values() for c in section.components())]:
            try:
                messages = sel.create().check(plan)
            except Exception as exc:  # a plugin bug, reported as such rather than as a traceback
                self.problem(sel.key, f"{sel.reg.kind} '{sel.name}' from {sel.reg.who()} failed in check(): "
                                      f"{one_line(exc)}")
                continue
            self.problems_of(sel.key, messages)
        # Then the plugins' tables, against a plan otherwise valid ([sweep] checks its values in it).
        for name, section in sections.items():
            if not self.problems:
                reg = self.registry.sections[name][0]
                try:
                    self.problems_of(name, section.check(plan))
                except Exception as exc:  # a plugin bug, reported as such rather than as a traceback
                    self.problem(name, f"plan section [{name}] from {reg.who()} failed in check(): {one_line(exc)}")
        return plan

    def named(self, raw: dict, table: str, kind: str) -> tuple[dict[str, Selected], set[str]]:
        """``[<table>.<name>]`` tables, each a component of ``kind``: the valid ones, and every name written."""
        tables = self.table(raw, table) or {}
        selected = {}
        for name, section in tables.items():
            if not isinstance(section, dict):
                self.problem(f"{table}.{name}", f"must be a table ([{table}.{name}]), got {type_name(section)}")
            elif sel := self.component(kind, f"{table}.{name}", section):
                selected[name] = sel
        return selected, set(tables)

    def problems_of(self, key: str, messages: list[str]) -> None:
        for msg in messages:
            self.problem(*subkey(key, msg))

    def sections(self, raw: dict, overrides: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """The tables plugins own: each installed section with its table read (``None`` if not written)."""
        out = {}
        for name, owners in self.registry.sections.items():
            table = raw.get(name)
            if name in overrides:
                table = {**(table if isinstance(table, dict) else {}), **overrides[name]}
            cls = owners[0].cls
            if table is not None and len(owners) > 1:
                self.problem(name, f"the table [{name}] is owned by both {owners[0].who()} and {owners[1].who()}; "
                                   "uninstall one of them")
                table = None
            parse = getattr(cls, "parse", None)
            if table is None:
                options = None
            elif parse is not None:  # with select(kind, name, key, options) for a table that selects components
                takes_select = len(inspect.signature(parse).parameters) > 2
                options = parse(table, self.problem, *([self.select] if takes_select else []))
            elif not isinstance(table, dict):
                self.problem(name, f"must be a table ([{name}]), got {type_name(table)}")
                options = None
            else:
                fields = {info.alias or f for f, info in cls.Options.model_fields.items()}
                for k in set(table) - fields:
                    self.problem(f"{name}.{k}", _unknown_key("unknown key", k, fields))
                options = self.validated(cls.Options, name, {k: v for k, v in table.items() if k in fields}, None)
            out[name] = cls(options)
        return out

    def folder_name(self, name: Any, path: str) -> bool:
        if isinstance(name, str) and _FOLDER.match(name):
            return True
        self.problem(path, f"{name!r} is not a usable folder name (letters, digits, '_', '-', '.')")
        return False

    def unique_name(self, name: Any, path: str, what: str, seen: set[str]) -> bool:
        """Check a name that becomes a folder in the run directory; two may not share one."""
        if not self.folder_name(name, path):
            return False
        if name in seen:
            self.problem(path, f"duplicate {what} name {name!r}; give each {what} a distinct 'name'")
            return False
        seen.add(name)
        return True

    def phases(self, value: Any, path: str, stages: list[str]) -> tuple[str, ...]:
        """``when`` as phases in run order; naming the last stage is the same as "after"."""
        items = value if isinstance(value, list) else [value]
        if not items or not all(isinstance(v, str) for v in items):
            self.problem(path, f"must be \"before\", \"after\", \"both\", a stage name or a list of them, "
                               f"got {value!r}")
            return ()
        wanted: set[str] = set()
        for item in items:
            if item == "both":
                wanted |= {"before", "after"}
            elif item in ("before", "after"):
                wanted.add(item)
            elif item in stages:
                wanted.add("after" if item == stages[-1] else item)
            else:
                self.problem(path, unknown_choice("phase", item, ["before", "after", "both", *stages])
                             + " (a stage name means: right after that stage)")
        return tuple(p for p in phase_order(stages) if p in wanted)


def subkey(key: str, message: str) -> tuple[str, str]:
    """A problem as ``check()`` words it, ``"sub.key: ..."`` or a message for all of ``key``, as the plan
    key it is under and the message: ``("model.path", "...")``."""
    sub = _SUBKEY.match(message)
    return (f"{key}.{sub.group(1)}" if key else sub.group(1), message[sub.end():]) if sub else (key, message)


def _splits(sel: Selected) -> list[str]:
    splits = getattr(sel.create(), "splits", None)
    return list(splits()) if callable(splits) else ["train"]


def _unknown_key(what: str, key: str, valid: Any) -> str:
    hint = did_you_mean(key, valid)
    return f"{what}{hint} {'Valid' if hint else '; valid'} keys: {', '.join(sorted(valid))}".replace(" ;", ";")


def _loc(loc: tuple) -> str:
    """A pydantic error location as a key path: ``.target_modules``, ``.tokenizer_data[0]``.
    Union member tags (``list[str]``, ``literal['all-linear']``) are not keys and are dropped."""
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc
                   if isinstance(p, int) or str(p).isidentifier())


def type_name(value: Any) -> str:
    return {dict: "a table", list: "an array", str: "a string", bool: "a boolean", int: "an integer",
            float: "a float"}.get(type(value), type(value).__name__)


def _pydantic_message(err: dict) -> str:
    if err.get("type") == "missing":
        return "missing required key"
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    msg = msg[0].lower() + msg[1:]
    if err.get("type") == "reference" or "input" not in err or isinstance(err["input"], dict):
        return msg  # a reference's message names what the plan has instead
    return f"{msg} (got {err['input']!r})"


def redact(value: Any) -> Any:
    """``value`` (a plan, a section, tags) with secrets replaced by ``***``: the value of a key that names
    one (``token``, ``api_key``, ...), any string shaped like a known access token (``hf_...``, ``sk-...``,
    GitHub, Slack) and the password of a URL (``postgresql://user:***@host/db``)."""
    if isinstance(value, dict):
        return {k: ("***" if _SECRET.search(str(k)) and v else redact(v)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    if isinstance(value, str) and _SECRET_VALUE.search(value):
        return "***"
    if isinstance(value, str):
        return _URL_PASSWORD.sub(r"\1:***@", value)
    return value
