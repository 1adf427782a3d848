"""``ftcore validate --data PLAN``: every row the plan's stages and evaluations use, read, converted
and rendered as a run would, then each stage's data prepared as the run prepares it, without loading
model weights.

Each row a run would reject is one line on stderr, ``data.<name>: FILE:LINE: message``, as the data
sources report it (``(skipped)`` at the end when the source's ``on_error = "skip"`` would drop it);
rows of a file with the same message are one line with their count. Then each stage's trainer prepares
its data (``prepare_data``, as ``ftcore prepare`` does: what the run would refuse, such as plain text
given to ``sft`` or a conversation without an answer, is refused here, and the tokenized data waits in
the cache for the run), and one summary line goes to stdout. :func:`check_plan_data` returns the exit
code: 2 when a run would stop on the data (a bad row under ``on_error = "error"``, a row the chat
template cannot render among them, a source with no row left, a stage's data its trainer refuses), else 0.

Rendering goes through :func:`ftcore_plugins.common.chat.row_samples`, the function a run's
tokenization uses, with the plan's template and the model's tokenizer (loaded from its folder; a
``scratch`` model's is trained on its ``tokenizer_data`` as the run does). Preference rows are
converted and checked, not rendered; an evaluation's rows are rendered whole.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, TextIO

from ftcore.context import DataContext, RunInfo
from ftcore.errors import FtcoreError

from ftcore_plugins.common import formats as F
from ftcore_plugins.common.run_data import Silent
from ftcore_plugins.data._source import RowSource, Unit, _base, _one_line, _quiet_datasets, placeholder_warning

RENDERED_KINDS = ("chat", "completion", "text")  # what row_samples turns into samples
BATCH = 1000



@dataclass
class Report:
    """What the check found: bad rows by reason, lines to print (``err``: bad rows, warnings and notes;
    ``out``: the summary), whether a run would stop."""

    out: TextIO
    err: TextIO
    rows: int = 0
    sources: int = 0
    files: int = 0
    reasons: Counter = field(default_factory=Counter)
    fatal: int = 0
    stops: int = 0  # problems a run would stop on that are not a row's (counted in fatal too)
    notes: list[str] = field(default_factory=list)

    def bad(self, prefix: str, where: str, message: str, reason: str, fatal: bool, count: int = 1) -> None:
        """Bad rows with one message, as the data sources report them: ``count`` rows, the first at ``where``."""
        self.reasons[reason] += count
        self.fatal += count if fatal else 0
        more = f" (and {count - 1:,} more row(s) like it)" if count > 1 else ""
        print(f"{prefix}: {where}{more}: {_one_line(message)}{'' if fatal else ' (skipped)'}", file=self.err)

    def stop(self, message: str) -> None:
        """A problem a run would stop on that is not a row's (a stage's data its trainer refuses)."""
        self.fatal += 1
        self.stops += 1
        print(_one_line(message), file=self.err)

    def summary(self) -> str:
        bad = sum(self.reasons.values())
        text = f"data: {self.rows:,} rows read from {self.files:,} file(s) in {self.sources} source(s); "
        others = f"; {self.stops:,} other problem(s) would stop the run" if self.stops else ""
        if not bad:
            return text + "no bad rows" + others
        reasons = ", ".join(f"{k.replace('_', ' ')}: {v:,}" for k, v in sorted(self.reasons.items()))
        rows = self.fatal - self.stops
        stop = f"{rows:,} would stop the run" if rows else "a run skips them all"
        return text + f"{bad:,} bad ({reasons}); {stop}{others}"


def evaluation_data(plan: Any) -> set[str]:
    """The data names the evaluations use (a mix's sources in its place)."""
    names: set[str] = set()

    def add(ref: str, seen: tuple[str, ...] = ()) -> None:
        name = ref.partition(":")[0]
        sources = getattr(plan.data[name].options, "sources", None)
        if isinstance(sources, dict) and name not in seen:
            for sub in sources:
                add(sub, (*seen, name))
            return
        names.add(name)

    for evaluation in getattr(plan, "evaluations", ()):
        if evaluation.data:
            add(evaluation.data)
    return names


def stage_data(plan: Any) -> dict[str, bool]:
    """The data names the stages use (a mix's sources in its place) -> ``train_on_inputs``
    (False when any stage using it trains on the answers only)."""
    names: dict[str, bool] = {}

    def add(ref: str, train_on_inputs: bool, seen: tuple[str, ...] = ()) -> None:
        name = ref.partition(":")[0]
        sources = getattr(plan.data[name].options, "sources", None)
        if isinstance(sources, dict) and name not in seen:  # a mix: check what it mixes
            for sub in sources:
                add(sub, train_on_inputs, (*seen, name))
            return
        names[name] = names.get(name, True) and train_on_inputs

    for stage in plan.stages:
        train_on_inputs = bool(getattr(stage.trainer.options, "train_on_inputs", False))
        for ref in (stage.data, stage.eval_data):
            if ref:
                add(ref, train_on_inputs)
    return names


def plan_tokenizer(plan: Any, load_data: Any) -> tuple[Any, str | None]:
    """The model's tokenizer as the run gets it, without the weights; or None and why not."""
    from transformers import AutoTokenizer

    loader = plan.model.create()
    o = loader.options
    path = getattr(o, "tokenizer", None) or getattr(o, "path", None)
    if path:
        kwargs = {k: getattr(o, k) for k in ("revision", "trust_remote_code") if getattr(o, k, None) is not None}
        token = getattr(o, "token", None)
        if token is not None:
            kwargs["token"] = token.get_secret_value() if hasattr(token, "get_secret_value") else token
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path), **kwargs)
        except (OSError, ValueError) as exc:
            raise FtcoreError(f"model: cannot load the tokenizer from {str(path)!r}: "
                              f"{_one_line(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)}") from None
    elif getattr(o, "tokenizer_data", None) and hasattr(loader, "_train_tokenizer"):
        # A scratch model trains its tokenizer on the plan's data: train it here the same way.
        try:
            tokenizer = loader._train_tokenizer(SimpleNamespace(data=load_data, reporter=Silent()))
        except FtcoreError as exc:
            return None, f"rows not rendered: the tokenizer is trained on data that does not load ({exc})"
    else:
        return None, f"rows not rendered: model '{plan.model.name}' names no tokenizer to load without the model"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    with_processor = getattr(loader, "with_processor", None)  # a scratch VLM: its family's tokens and template
    return (with_processor(tokenizer) if with_processor is not None else tokenizer), None


def check_plan_data(plan: Any, out: TextIO | None = None) -> int:
    """Check every row of the data the plan's stages and evaluations use, then prepare each stage's
    data as the run does; print the bad rows (stderr) and a summary (stdout). ``out``: one stream for
    both. Returns 2 when a run would stop on the data, else 0."""
    from ftcore_plugins.common.chat import row_samples
    from ftcore_plugins.common.prepare import template_notes
    from ftcore_plugins.common.spans import SpanLocator, template_title

    report = Report(out or sys.stdout, out or sys.stderr)
    names = stage_data(plan)
    evaluated = {n: True for n in evaluation_data(plan) if n not in names}  # rendered whole
    tokenizer_data = set(getattr(getattr(plan.model, "options", None), "tokenizer_data", None) or ())
    for name in plan.data:
        if name not in names and name not in evaluated and not _mix(plan, name):
            why = "read only to train the tokenizer" if name in tokenizer_data else "no stage or evaluation uses it"
            print(f"note: data.{name} is not checked: {why}", file=report.err)
    if not names and not evaluated:
        print("data: no stage or evaluation uses data; nothing to check", file=report.out)
        return 0
    reporter = Silent()
    run = RunInfo(plan, plan.run_dir)
    loaded: dict[str, Any] = {}
    sources: dict[str, Any] = {}  # name -> the component loaded, for its data report

    def load_data(ref: str) -> Any:  # as the runner loads a reference, for a scratch tokenizer
        name, _, split = ref.partition(":")
        if name not in loaded:
            sources[name] = plan.data[name].create()
            data = sources[name].load(DataContext(run, reporter, name, load_data))
            loaded[name] = data if isinstance(data, dict) else {"train": data}
        return loaded[name][split or "train"]

    checked = {**names, **evaluated}
    readable: dict[str, Any] = {}

    def rows_that_load(ref: str) -> Any:
        """For a scratch tokenizer: the rows of a source checked below that load (its bad rows are skipped here
        and reported there, once each), so that the good rows are still rendered; any other source as a run reads it."""
        name, _, split = ref.partition(":")
        sel = plan.data[name]
        if name not in checked or not hasattr(sel.options, "on_error"):
            return load_data(ref)
        if name not in readable:
            source = sel.reg.cls(sel.options.model_copy(update={"on_error": "skip"}))
            data = source.load(DataContext(run, reporter, name, rows_that_load))
            readable[name] = data if isinstance(data, dict) else {"train": data}
        return readable[name][split or "train"]

    with _quiet_datasets():
        tokenizer, note = plan_tokenizer(plan, rows_that_load)
        if note:
            report.notes.append(note)
        template = plan.template.create()
        locator = SpanLocator(template, tokenizer)  # one for all rows: what it learns of the template is kept
        title = template_title(template)

        images: list[Any] = []  # the template and locator for rows with images, made at the first such row

        def render(row: dict, train_on_inputs: bool) -> None:
            use, spans = template, locator
            if row.get("images"):  # rendered as the run renders them: each <image> an image part
                if not images:
                    from ftcore_plugins.common.vision import image_template

                    wrapped = image_template(template)  # a text-only template: one line, as a run says it
                    images[:] = [wrapped, SpanLocator(wrapped, tokenizer)]
                use, spans = images
            try:
                row_samples(row, tokenizer, use, train_on_inputs=train_on_inputs, add_eos_to_text=True,
                            locator=spans)
            except FtcoreError as exc:
                message = str(exc)
                raise FtcoreError(message if message.startswith("template ") else f"{title}: {message}") from None

        for name, train_on_inputs in checked.items():
            ctx = DataContext(run, reporter, name, load_data)
            _check_source(plan.data[name], ctx, report, render if tokenizer is not None else None, train_on_inputs)
        for line in template_notes({"end_token_added": locator.closed_by_us,
                                    "reasoning_dropped": locator.dropped_reasoning}, template, tokenizer):
            print(f"warning: {line}", file=report.err)
    if not report.fatal:
        _train_overlap(plan, load_data, sources, report)
    if not report.fatal and names:
        _prepare_stages(plan, report)
    for line in report.notes:
        print(f"note: {line}", file=report.err)
    print(report.summary(), file=report.out)
    return 2 if report.fatal else 0


def _mix(plan: Any, name: str) -> bool:
    """Whether ``name`` is a mix (its sources are checked in its place)."""
    return isinstance(getattr(plan.data[name].options, "sources", None), dict)


def _train_overlap(plan: Any, load_data: Any, sources: dict[str, Any], report: Report) -> None:
    """Each evaluation's data loaded as the run loads it, which compares it with the training data
    (:mod:`ftcore_plugins.data._overlap`): a warning per training source its rows repeat, and what
    ``train_overlap = "drop"`` leaves out."""
    from ftcore_plugins.data._overlap import evaluation_refs, messages

    for name in dict.fromkeys(ref.partition(":")[0] for ref in evaluation_refs(plan)):
        try:
            with _quiet_datasets():
                load_data(name)
        except FtcoreError as exc:  # "drop" would leave no row to evaluate on
            report.stop(str(exc))
            continue
        stats = getattr(sources.get(name), "stats", None) or {}
        for line in messages(name, stats):
            print(f"data.{name}: warning: {line}", file=report.err)
        if stats.get("dropped_train_overlap"):
            print(f"data.{name}: note: train_overlap = \"drop\" leaves out {stats['dropped_train_overlap']:,} of "
                  f"these rows; {stats['rows_kept']:,} left", file=report.err)


def _prepare_stages(plan: Any, report: Report) -> None:
    """Each stage's data prepared as the run prepares it (``ftcore prepare``): the stage trainer's own
    ``prepare_data`` on the run's tokenizer (the template's tokens added to a model on the meta device,
    no weights read) refuses what the run would, before any model loads; what it tokenizes is cached
    for the run. A trainer without ``prepare_data`` (dpo, kto, the online ones) reads its rows as it
    trains: its rows were converted above."""
    from ftcore.errors import ComponentError
    from ftcore.plugins import get_plugin_manager
    from ftcore.runner import Runner, calling

    from ftcore_plugins.common.run_data import data_context, data_tokenizer

    runner = Runner(plan, get_plugin_manager(), None)
    runner.reporter = runner.info.reporter = Silent()
    loader = plan.model.create()
    if not (hasattr(loader, "load_tokenizer") and hasattr(loader, "meta_model")):
        report.notes.append(f"stages' data not prepared: model '{plan.model.name}' cannot give its tokenizer "
                            "without its weights")
        return
    try:
        with _quiet_datasets():
            model, tokenizer = data_tokenizer(runner)
    except (FtcoreError, ComponentError) as exc:
        report.notes.append(f"stages' data not prepared: {_one_line(str(exc))}")
        return
    for stage in plan.stages:
        trainer = stage.trainer.create()
        if not hasattr(trainer, "prepare_data"):
            report.notes.append(f"stage {stage.name}: trainer '{stage.trainer.name}' tokenizes its rows as it "
                                "trains; they were converted, not prepared")
            continue
        try:
            with _quiet_datasets():
                ctx = data_context(runner, stage, model, tokenizer)
                if not hasattr(ctx.train_data, "__len__"):  # a streaming source: read as the stage trains
                    continue
                with calling(stage.trainer, "prepare_data"):
                    trainer.prepare_data(ctx)
        except (FtcoreError, ComponentError) as exc:
            report.stop(str(exc))


def _check_source(sel: Any, ctx: DataContext, report: Report, render: Any, train_on_inputs: bool) -> None:
    prefix = f"data.{ctx.name}"
    report.sources += 1
    component = sel.create()
    if not isinstance(component, RowSource):  # not ours: its rows as it loads them, placed by number
        data = component.load(ctx)
        data = data.get("train") if isinstance(data, dict) else data
        unit = Unit(prefix, rows=[dict(r) for r in data], locate_many=lambda idx: {i: f"row {i + 1}" for i in idx})
        report.rows += len(unit)
        _, bad = _check_unit(unit, "auto", {}, "allow", "error", [None], render, train_on_inputs, [0, None])
        for args in _grouped(unit, [], bad):
            report.bad(prefix, *args)
        return
    o = sel.options
    on_error = getattr(o, "on_error", "error")
    # Read with "skip", so that a bad line is reported and the reading goes on.
    component = sel.reg.cls(o.model_copy(update={"on_error": "skip"}) if hasattr(o, "on_error") else o)
    fmt = component._fixed_format()
    columns = dict(getattr(o, "columns", {}))
    placeholders = getattr(o, "placeholders", "allow")
    kind: list[str | None] = [None]
    found: list = [0, None]
    kept = read = 0
    fatal_before = report.fatal
    for unit in component._checked_units(ctx, prefix, getattr(o, "limit", None)):
        n = len(unit) + len(unit.rejected)
        report.files += 1
        if n == 0:
            report.bad(prefix, unit.shown, "no rows (an empty file?)", "empty_file", True)
            continue
        read += n
        rejected = [(where, str(err), err.reason, on_error == "error" and err.reason not in F.ALWAYS_SKIP)
                    for where, err in unit.rejected]
        good, bad = _check_unit(unit, fmt, columns, placeholders, on_error, kind, render, train_on_inputs, found)
        kept += good
        for args in _grouped(unit, rejected, bad):
            report.bad(prefix, *args)
    report.rows += read
    if found[0]:
        print(f"{prefix}: warning: {placeholder_warning(*found)}", file=report.err)
    if read and not kept and report.fatal == fatal_before:  # all skipped (bad rows that stop the run said so)
        report.stop(f"{prefix}: no rows left: all {read:,} rows would be skipped")


def _grouped(unit: Unit, rejected: list[tuple[str, str, str, bool]],
             bad: list[tuple[int, str, str, bool]]) -> list[tuple[str, str, str, bool, int]]:
    """A unit's bad rows in file order, those with one message together: ``(where the first is, message,
    reason, stops the run, how many)``. Only each group's first row is located."""
    groups: dict[tuple, list] = {}
    for i, message, reason, fatal in bad:
        key = (_one_line(message), reason, fatal)
        groups.setdefault(key, [i, 0])[1] += 1
    where = unit.locate([first for first, _ in groups.values()]) if groups else {}
    entries = [(where[first], *key, count) for key, (first, count) in groups.items()]
    taken: dict[tuple, list] = {}
    for place, message, reason, fatal in rejected:
        key = (_one_line(message), reason, fatal)
        taken.setdefault(key, [place, 0])[1] += 1
    entries += [(place, *key, count) for key, (place, count) in taken.items()]
    return sorted(entries, key=_place) if rejected else entries


def _check_unit(unit: Unit, fmt: str, columns: dict, placeholders: str, on_error: str, kind: list, render: Any,
                train_on_inputs: bool, found: list) -> tuple[int, list[tuple[int, str, str, bool]]]:
    """Convert (and render) each row of one unit. Returns the rows a run would keep and the bad
    ones as ``(row index, message, reason, stops the run)``. ``kind[0]`` is the source's kind, set
    by its first good row; ``found`` counts the rows holding placeholders (and the first)."""
    bad: list[tuple[int, str, str, bool]] = []  # (index, message, reason, stops the run)
    kept = 0
    for i, row in enumerate(_rows(unit)):
        try:
            _, row_kind, converted, placeholder = F.convert_kind(
                row, fmt, kind[0], columns=columns, strings=unit.strings, placeholders=placeholders, base=_base(unit))
        except F.RowError as exc:
            bad.append((i, str(exc), exc.reason, exc.reason == "mixed_kind"
                        or (on_error == "error" and exc.reason not in F.ALWAYS_SKIP)))
            continue
        kind[0] = row_kind  # the source's kind: its first good row's
        if placeholder is not None:
            if found[1] is None:
                found[1] = f"{unit.locate([i])[i]}: {placeholder}"
            found[0] += 1
        if render is not None and row_kind in RENDERED_KINDS:
            try:
                render(converted, train_on_inputs)
            except Exception as exc:  # a run stops here, or skips the row and counts it under on_error = "skip"
                message = str(exc) if isinstance(exc, FtcoreError) else f"{type(exc).__name__}: {exc}"
                bad.append((i, f"cannot render with the template: {message}", "render_error", on_error == "error"))
                continue
        kept += 1
    return kept, bad


def _rows(unit: Unit) -> Any:
    if unit.dataset is None:
        yield from unit.rows or []
        return
    for batch in unit.dataset.iter(batch_size=BATCH):
        keys = list(batch)
        for i in range(len(batch[keys[0]]) if keys else 0):
            yield {k: batch[k][i] for k in keys}


_PLACE = re.compile(r"(?::(\d+)|: row (\d+))")


def _place(entry: tuple) -> int:
    """The line (or row) number a place names, to put a file's bad rows in order."""
    found = _PLACE.search(entry[0].rsplit(" (line", 1)[0])
    return int(found.group(1) or found.group(2)) if found else 0
