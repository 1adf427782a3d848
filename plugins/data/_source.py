"""Shared machinery of the built-in data sources, built on 🤗 datasets.

A source reads one or more *units* (a file, a saved dataset, a hub split) into raw rows,
converts them to the internal schema with :mod:`ftcore_plugins.common.formats` in a batched
``Dataset.map`` (memory-mapped Arrow, cached, ``num_proc`` workers), and reports every
bad row as one line naming the file, the line (JSON) or row (CSV, Parquet, ...) and the
field. ``datasets`` gives no line numbers when a file does not parse, so then the file is
streamed here to find the exact place (and, with ``on_error = "skip"``, to read the rows
around it).

A subclass sets ``name`` and ``Options`` and implements ``_read(path, ctx) -> Unit``
(file sources, :class:`FileSource`) or ``_units(ctx)`` (anything else).
"""

from __future__ import annotations

import codecs
import contextlib
import csv
import functools
import glob
import io
import json
import logging
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, PlainSerializer, ValidationInfo

from ftcore.component import Component
from ftcore.errors import FtcoreError, did_you_mean

from ftcore_plugins.common import formats as F
from ftcore_plugins.common.prepare import ARROW_BATCH_ROWS, ARROW_PAGES
from ftcore_plugins.data._overlap import check_overlap, plan_problems
from ftcore_plugins.data._quality import QualityOptions, clean_and_split

log = logging.getLogger("ftcore")

SHOWN_ERRORS = 3  # skipped rows shown one by one; the rest are counted
# A `limit` up to this many rows is read in Python, no further than it (a sample of a big file); a larger
# one reads the files through datasets (Arrow, memory-mapped), and in Python only if that fails.
SMALL_LIMIT = 20_000
MAP_BATCH = 1000


# -- options ---------------------------------------------------------------------------------------

def _resolve_paths(value: str | list[str], info: ValidationInfo) -> tuple[Path, ...]:
    """A file, a glob or a list of them, relative to the plan's folder -> the files, in order."""
    base = (info.context or {}).get("base_dir")
    items = [value] if isinstance(value, str) else list(value)
    if not items:
        raise ValueError("names no file: give a path, a glob or a list of them")
    out: list[Path] = []
    for item in items:
        if not item:
            raise ValueError("an empty path")
        try:
            p = Path(item).expanduser()
        except RuntimeError as exc:  # "~nosuchuser/..."
            raise ValueError(f"cannot expand {item!r}: {exc}") from None
        if base is not None and not p.is_absolute():
            p = Path(base) / p
        if glob.has_magic(item):
            found = sorted(Path(m).resolve() for m in glob.glob(str(p), recursive=True) if Path(m).is_file())
            if not found:
                raise ValueError(f"no file matches {str(p)!r}")
            out.extend(found)
            continue
        p = p.resolve() if base is not None else p
        if not p.exists():
            raise ValueError(f"no such file or folder: {p}")
        if p.is_dir():
            raise ValueError(f"{p} is a folder; name its files, e.g. with a glob like '{item.rstrip('/')}/*.jsonl'")
        out.append(p)
    return tuple(dict.fromkeys(out))  # each file once


Paths = Annotated[str | list[str], AfterValidator(_resolve_paths),
                  PlainSerializer(lambda files: [str(f) for f in files], return_type=list[str])]
"""A file, a glob or a list of them; validated to a tuple of existing files."""


def _check_columns(value: dict[str, str]) -> dict[str, str]:
    for ours, theirs in value.items():
        if ours not in F.FIELDS:
            raise ValueError(f"unknown field {ours!r}{did_you_mean(ours, F.FIELDS)} (the keys are our field names: "
                             f"{', '.join(F.FIELDS)}; the values are the file's)")
        if not theirs:
            raise ValueError(f"{ours!r} maps to an empty name")
    return value


def _check_keep(value: list[str]) -> list[str]:
    for name in value:
        if name.startswith("__"):
            raise ValueError(f"{name!r}: names starting with '__' are reserved")
    if len(set(value)) != len(value):
        raise ValueError("names a column twice")
    return value


Format = Literal[F.FORMAT_NAMES]  # type: ignore[valid-type]


class RowOptions(QualityOptions):
    """Options every built-in source has: these, and the filters, dedup and split of
    :class:`ftcore_plugins.data._quality.QualityOptions`."""

    format: Format = "auto"  # type: ignore[valid-type]
    columns: Annotated[dict[str, str], AfterValidator(_check_columns)] = {}
    on_error: Literal["error", "skip"] = "error"
    # Message text holding an unfilled "{{name}}": one warning with the count, an error per row, or nothing.
    placeholders: Literal[F.PLACEHOLDERS] = "warn"  # type: ignore[valid-type]
    limit: Annotated[int, Field(ge=1)] | None = None
    keep: Annotated[list[str], AfterValidator(_check_keep)] = []
    num_proc: Annotated[int, Field(ge=1)] | None = None


class FileOptions(RowOptions):
    path: Paths
    # Read the files as they train (a 🤗 IterableDataset), never prepared as a whole: for corpora
    # that should not be. The stage needs max_steps; dedup and validation splits need the whole data.
    streaming: bool = False


# -- units -----------------------------------------------------------------------------------------

@dataclass
class Unit:
    """Raw rows from one place: an Arrow ``dataset``, or Python ``rows`` when datasets could
    not read the file (then ``lines`` holds each row's line). ``rejected`` are rows the
    reader already threw out (bad JSON lines, ...), with where they were."""

    shown: str  # the file as messages name it
    dataset: Any = None
    rows: list[dict] | None = None
    lines: list[int] | None = None
    rejected: list[tuple[str, F.RowError]] = field(default_factory=list)
    strings: bool = False  # every value is a string (CSV)
    locate_many: Callable[[list[int]], dict[int, str]] | None = None  # row index -> "file:line" / "file: row n"
    path: Path | None = None

    def __len__(self) -> int:
        return len(self.dataset) if self.dataset is not None else len(self.rows or [])

    @property
    def column_names(self) -> list[str]:
        if self.dataset is not None:
            return list(self.dataset.column_names)
        return list(dict.fromkeys(k for r in self.rows or [] for k in r))

    def limit(self, n: int) -> None:
        """At most ``n`` rows, rejected ones counted first (a reader that stops at its budget already
        read no more)."""
        self.rejected = self.rejected[:n]
        n -= len(self.rejected)
        if len(self) <= n:
            return
        if self.dataset is not None:
            self.dataset = self.dataset.select(range(n))
        else:
            self.rows, self.lines = self.rows[:n], (self.lines or [])[:n] or None

    def locate(self, indices: list[int]) -> dict[int, str]:
        if self.rows is not None and self.lines is not None:
            return {i: f"{self.shown}:{self.lines[i]}" for i in indices}
        if self.locate_many is not None:
            return self.locate_many(indices)
        return {i: f"{self.shown}: row {i + 1}" for i in indices}


class SkippedRows:
    """The skipped rows a source shows: its first :data:`SHOWN_ERRORS` different messages, each once,
    where it first occurred and how many rows share it (25 rows of one unknown format are one line),
    reasons in ``silent`` left out."""

    def __init__(self, silent: tuple[str, ...] = ()):
        self.silent = silent
        self.places: dict[str, str] = {}  # message -> where it first occurred
        self.counts: Counter = Counter()

    def add(self, where: str, err: F.RowError) -> None:
        message = self._message(err)
        if message is not None and (message in self.places or len(self.places) < SHOWN_ERRORS):
            self.places.setdefault(message, where)
            self.counts[message] += 1

    def add_located(self, errors: list[tuple[int, F.RowError]], unit: Unit) -> None:
        """``(row index, error)`` pairs of ``unit``: only the rows shown are located."""
        new: dict[str, int] = {}
        for i, err in errors:
            message = self._message(err)
            if message is None:
                continue
            if message in self.places or message in new:
                self.counts[message] += 1
            elif len(self.places) + len(new) < SHOWN_ERRORS:
                new[message] = i
                self.counts[message] += 1
        where = unit.locate(list(new.values())) if new else {}
        for message, i in new.items():
            self.places[message] = where[i]

    def _message(self, err: F.RowError) -> str | None:
        return None if err.reason in self.silent else _one_line(str(err))

    def first(self) -> str | None:
        return next((f"{where}: {message}" for message, where in self.places.items()), None)

    def lines(self) -> list[str]:
        out = []
        for message, where in self.places.items():
            more = self.counts[message] - 1
            out.append(f"{where}: {message} (skipped{f'; {more:,} more row(s) like it' if more else ''})")
        return out

    def __bool__(self) -> bool:
        return bool(self.places)


def _rows_of(shown: str) -> Callable[[list[int]], dict[int, str]]:
    return lambda indices: {i: f"{shown}: row {i + 1}" for i in indices}


# -- the base class ----------------------------------------------------------------------------------

class RowSource(Component):
    """Base for sources whose rows go through the formats of :mod:`ftcore_plugins.common.formats`.

    After ``load`` the instance has ``stats``: rows read, rows kept, rows skipped per
    reason, formats seen and per-unit counts.
    """

    Options = RowOptions
    stats: dict[str, Any]
    silent_skips: tuple[str, ...] = ()  # reasons counted in stats but not warned about
    # While a unit is read under `limit`: the rows left to read (rejected ones count); None: no limit.
    # A reader that can stop early reads no further (the built-in file readers and FileSource do).
    row_budget: int | None = None

    def _units(self, ctx: Any) -> Iterator[Unit]:
        raise NotImplementedError

    def _fixed_format(self) -> str:
        return self.options.format

    def splits(self) -> list[str]:
        return ["train", "validation"] if getattr(self.options, "validation", None) else ["train"]

    def check(self, plan: Any) -> list[str]:
        return plan_problems(self.options, plan)

    def load(self, ctx: Any) -> Any:
        """The rows as a Dataset; with ``validation`` set, ``{"train": ..., "validation": ...}``."""
        with _quiet_datasets():
            data = self._load(ctx)
        if not isinstance(self.options, QualityOptions):
            ARROW_PAGES.release()
            return data
        parts = clean_and_split(data, self.options, self.stats, f"data.{ctx.name}", warn=ctx.reporter.warn)
        dropped = {k[len("dropped_"):]: v for k, v in self.stats.items() if k.startswith("dropped_") and v}
        if dropped:
            ctx.reporter.info(f"data [bold]{ctx.name}[/]: dropped " + ", ".join(
                f"{v:,} {k.replace('_', ' ')}" for k, v in dropped.items()) + f"; {self.stats['rows_kept']:,} left")
        parts = check_overlap(parts, self.options, ctx, self.stats)  # evaluation data against the training data
        ARROW_PAGES.release()  # what the reading, filter, split and overlap passes touched
        if "validation" in parts:
            ctx.reporter.info(f"data [bold]{ctx.name}[/]: {len(parts['train']):,} train, "
                              f"{len(parts['validation']):,} validation rows ({self.options.split_strategy} split)")
            return parts
        return parts["train"]

    def _load(self, ctx: Any) -> Any:
        import datasets

        o = self.options
        prefix = f"data.{ctx.name}"
        fmt = self._fixed_format()
        keep = list(getattr(o, "keep", []))
        on_error = getattr(o, "on_error", "error")
        stats: dict[str, Any] = {"source": self.name, "kind": None, "rows_read": 0, "rows": 0, "skipped": {},
                                 "formats": {}, "files": []}
        self.stats = stats
        skipped: Counter = Counter()
        formats: Counter = Counter()
        shown_errors = SkippedRows(self.silent_skips)
        placeholders: list = [0, None]  # rows holding one, and the first as "file:line: ..."
        parts, kind, first_shown = [], None, None

        for unit in self._checked_units(ctx, prefix, getattr(o, "limit", None)):
            for where, err in unit.rejected:
                if on_error == "error":
                    raise FtcoreError(f"{prefix}: {where}: {_one_line(str(err))}")
                skipped[err.reason] += 1
                shown_errors.add(where, err)
            n_read = len(unit) + len(unit.rejected)
            if n_read == 0:
                raise FtcoreError(f"{prefix}: {unit.shown}: no rows (an empty file?)")
            stats["rows_read"] += n_read
            if not len(unit):  # every row was rejected while reading
                stats["files"].append({"path": unit.shown, "rows_read": n_read, "rows": 0})
                continue
            self._check_fields(unit, prefix)
            unit_kind = self._scan_kind(unit, fmt, kind, prefix, on_error)
            if kind is not None and unit_kind != kind:
                raise FtcoreError(f"{prefix}: {unit.shown}: holds {unit_kind.replace('_', ' ')} rows but {first_shown} "
                                  f"holds {kind.replace('_', ' ')} rows; one source holds one kind of rows: split "
                                  "them into separate [data.*] sources")
            kind, first_shown = unit_kind, first_shown or unit.shown
            clash = [k for k in keep if k in F.KIND_COLUMNS[kind]]
            if clash:
                raise FtcoreError(f"{prefix}: keep names {', '.join(map(repr, clash))}, which is also a column of "
                                  f"{kind.replace('_', ' ')} rows; keep it under another name, or not at all")
            out = self._convert(unit, fmt, kind, keep)
            formats.update(_value_counts(out, F.FORMAT_COLUMN))
            if F.PLACEHOLDER_COLUMN in out.column_names:
                out = _count_placeholders(out, unit, placeholders)
            out, errors = _split_errors(out)
            if errors:
                fatal = next((e for e in errors if e[1].reason == "mixed_kind"
                              or (on_error == "error" and e[1].reason not in F.ALWAYS_SKIP)), None)
                if fatal is not None:
                    i, err = fatal
                    raise FtcoreError(f"{prefix}: {unit.locate([i])[i]}: {_one_line(str(err))}")
                for i, err in errors:
                    skipped[err.reason] += 1
                shown_errors.add_located(errors, unit)
            out = out.remove_columns([F.ERROR_COLUMN, F.FORMAT_COLUMN])
            stats["files"].append({"path": unit.shown, "rows_read": n_read, "rows": len(out)})
            parts.append(out)

        stats["skipped"] = dict(sorted(skipped.items()))
        stats["formats"] = dict(sorted(formats.items()))
        total_skipped = sum(skipped.values())
        reasons = ", ".join(f"{k.replace('_', ' ')}: {v:,}" for k, v in stats["skipped"].items())
        parts = [p for p in parts if len(p)]
        if not parts:
            # Bad input is one line: the count, the reasons and the first row, not a warning per row first.
            first = shown_errors.first()
            raise FtcoreError(f"{prefix}: no rows left: all {stats['rows_read']:,} rows were skipped ({reasons})"
                              + (f"; the first: {first}" if first else "")
                              + "; `ftcore validate --data PLAN` lists them" if total_skipped else f"{prefix}: no rows")
        if shown_errors:
            stats["skipped_first"] = shown_errors.lines()  # the data report's copy of the warnings below
        for line in shown_errors.lines():
            ctx.reporter.warn(f"{prefix}: {line}")
        if placeholders[0]:
            stats["placeholder_rows"] = placeholders[0]
            ctx.reporter.warn(f"{prefix}: {placeholder_warning(*placeholders)}")
        loud = sum(v for k, v in skipped.items() if k not in self.silent_skips)
        if loud:
            ctx.reporter.warn(f"{prefix}: skipped {total_skipped:,} of {stats['rows_read']:,} rows ({reasons})")
        stats["kind"] = kind
        if len(parts) > 1:
            base = parts[0].features
            try:
                parts = [parts[0], *(p.cast(base) if p.features != base else p for p in parts[1:])]
            except Exception as exc:
                raise FtcoreError(f"{prefix}: the files' kept columns ({', '.join(keep)}) have different types: "
                                  f"{_first_line(exc)}") from None
            ds = datasets.concatenate_datasets(parts)
        else:
            ds = parts[0]
        ds = _prune(ds, kind, getattr(o, "num_proc", None))
        stats["rows"] = len(ds)
        columns = [c for c in F.KIND_COLUMNS[kind] if c in ds.column_names] + keep
        if ds.column_names != columns:
            ds = ds.select_columns(columns)
        what = ", ".join(stats["formats"]) or kind
        where = stats["files"][0]["path"] if len(stats["files"]) == 1 else f"{len(stats['files'])} files"
        ctx.reporter.info(f"data [bold]{ctx.name}[/]: {len(ds):,} {kind.replace('_', ' ')} rows ({what}) "
                          f"from {where}")
        return ds

    def _checked_units(self, ctx: Any, prefix: str, limit: int | None = None) -> Iterator[Unit]:
        """The units, with a reader's FtcoreError given the source's prefix. With ``limit``, at most
        that many rows over all units (rows a reader rejects count): a reader stops reading there
        (``row_budget``), so nothing after it is read, a bad row neither."""
        units = self._units(ctx)
        remaining = limit
        while remaining is None or remaining > 0:
            self.row_budget = remaining
            try:
                unit = next(units)
            except StopIteration:
                return
            except FtcoreError as exc:
                msg = _one_line(str(exc))
                raise FtcoreError(msg if msg.startswith(f"{prefix}: ") else f"{prefix}: {msg}") from None
            finally:
                self.row_budget = None
            if remaining is not None:
                unit.limit(remaining)
                remaining -= len(unit) + len(unit.rejected)
            yield unit

    # -- steps -------------------------------------------------------------------------------------
    def _check_fields(self, unit: Unit, prefix: str) -> None:
        names = unit.column_names
        o = self.options
        for ours, theirs in getattr(o, "columns", {}).items():
            if theirs not in names:
                raise FtcoreError(f"{prefix}: {unit.shown}: columns maps {ours!r} to {theirs!r}, which is not a "
                                  f"field of the file{did_you_mean(theirs, names)} (fields: {', '.join(names) or 'none'})")
        for name in getattr(o, "keep", []):
            if name not in names:
                raise FtcoreError(f"{prefix}: {unit.shown}: keep names {name!r}, which is not a field of the "
                                  f"file{did_you_mean(name, names)} (fields: {', '.join(names) or 'none'})")

    def _scan_kind(self, unit: Unit, fmt: str, expected: str | None, prefix: str, on_error: str) -> str:
        """The kind of the unit's first row that converts. With on_error = "error", a first row
        that does not convert is the first error: report it without converting the rest."""
        columns = getattr(self.options, "columns", {})
        for i, row in enumerate(_iter_rows(unit)):
            try:
                return F.convert(row, fmt, columns=columns, strings=unit.strings,
                                 placeholders=getattr(self.options, "placeholders", "allow"), base=_base(unit))[1]
            except F.RowError as exc:
                if exc.reason in F.ALWAYS_SKIP:
                    continue
                if on_error == "error":
                    raise FtcoreError(f"{prefix}: {unit.locate([i])[i]}: {_one_line(str(exc))}") from None
        return expected or "chat"  # nothing converts: every row reports its own error

    def _convert(self, unit: Unit, fmt: str, kind: str, keep: list[str]) -> Any:
        import datasets

        columns = dict(getattr(self.options, "columns", {}))
        placeholders = getattr(self.options, "placeholders", "allow")
        fn = functools.partial(_convert_batch, fmt=fmt, kind=kind, columns=columns, strings=unit.strings,
                               placeholders=placeholders, base=_base(unit))
        helper = {F.ERROR_COLUMN: datasets.Value("string"), F.FORMAT_COLUMN: datasets.Value("string")}
        if placeholders == "warn":
            helper[F.PLACEHOLDER_COLUMN] = datasets.Value("string")
        if unit.dataset is not None:
            ds = unit.dataset
            feats = datasets.Features({**F.features(kind), **helper, **{k: ds.features[k] for k in keep}})
            # datasets hashes `fn` by reference, not by the code it calls: put our code in the fingerprint.
            fingerprint = _fingerprint(ds._fingerprint, "convert", fmt, kind, sorted(columns.items()), unit.strings,
                                       keep, placeholders, *([] if _base(unit) is None else [_base(unit)]))
            # the output's record batches: ARROW_BATCH_ROWS, not datasets' 1,000
            return ds.map(fn, batched=True, batch_size=ARROW_BATCH_ROWS, writer_batch_size=ARROW_BATCH_ROWS,
                          remove_columns=[c for c in ds.column_names if c not in keep], features=feats,
                          num_proc=_num_proc(getattr(self.options, "num_proc", None), len(ds)),
                          new_fingerprint=fingerprint, desc=f"convert {unit.shown}")
        rows = unit.rows or []
        cols = F.convert_rows(rows, fmt, kind, columns=columns, strings=unit.strings, placeholders=placeholders,
                              base=_base(unit))
        out = datasets.Dataset.from_dict(cols, features=datasets.Features({**F.features(kind), **helper}))
        for k in keep:
            try:
                out = out.add_column(k, [r.get(k) for r in rows])
            except Exception as exc:
                raise FtcoreError(f"{unit.shown}: cannot keep column {k!r}: {_one_line(str(exc))}") from None
        return out


class FileSource(RowSource):
    """Base for sources that read files: ``path`` is a file, a glob or a list of them.

    A source that sets ``stream_builder`` (the 🤗 datasets builder that reads its files, with
    ``stream_kwargs(path)``) can stream: ``streaming = true``."""

    Options = FileOptions
    stream_builder: str | None = None

    def inputs(self) -> list[Path]:
        return list(self.options.path)

    def check(self, plan: Any) -> list[str]:
        return super().check(plan) + (streaming_problems(self, plan) if getattr(self.options, "streaming", False)
                                      else [])

    def load(self, ctx: Any) -> Any:
        if getattr(self.options, "streaming", False):
            with _quiet_datasets():
                return self._stream(ctx)
        return super().load(ctx)

    def stream_kwargs(self, path: Path) -> dict[str, Any]:
        """Further ``datasets.load_dataset`` arguments for streaming ``path``."""
        return {}

    def _stream(self, ctx: Any) -> Any:
        """The files as a 🤗 ``IterableDataset`` in the internal schema: converted, checked and
        filtered batch by batch as training reads them. A bad row stops training with the row's
        number (or, with ``on_error = "skip"``, is counted in the log and skipped)."""
        import datasets

        from ftcore_plugins.data._quality import filtered_out

        o, prefix = self.options, f"data.{ctx.name}"
        files = list(o.path)
        shown = _shown(files[0], ctx) if len(files) == 1 else f"{len(files)} files"
        for path in files:
            if path.stat().st_size == 0:
                raise FtcoreError(f"{prefix}: {_shown(path, ctx)}: empty file")
        raw = datasets.load_dataset(self.stream_builder, data_files=[str(f) for f in files], split="train",
                                    streaming=True, **self.stream_kwargs(files[0]))
        try:
            first = next(iter(raw), None)
        except Exception as exc:  # the builder cannot parse the start of the file
            raise FtcoreError(f"{prefix}: {shown}: cannot read it as {self.name}: {_first_line(exc)}") from None
        if first is None:
            raise FtcoreError(f"{prefix}: {shown}: no rows (an empty file?)")
        fmt, columns, strings = self._fixed_format(), dict(o.columns), self.stream_builder == "csv"
        base = str(files[0].parent) if len({f.parent for f in files}) == 1 else None
        try:
            kind, first_row = F.convert(first, fmt, columns=columns, strings=strings, placeholders="allow", base=base)[1:]
        except F.RowError as exc:
            raise FtcoreError(f"{prefix}: {shown}: row 1: {_one_line(str(exc))}") from None
        skipped: Counter = Counter()

        def convert(batch: dict, indices: list[int]) -> dict:
            out = F.convert_batch(batch, fmt=fmt, kind=kind, columns=columns, strings=strings, placeholders="allow",
                                  base=base)
            if not images:
                out.pop("images", None)
            errors = out.pop(F.ERROR_COLUMN)
            out.pop(F.FORMAT_COLUMN)
            keep = []
            for j, error in enumerate(errors):
                if error is not None:
                    err = F.RowError.decode(error)
                    if o.on_error == "error" and err.reason not in F.ALWAYS_SKIP:
                        raise FtcoreError(f"{prefix}: {shown}: row {indices[j] + 1}: {_one_line(str(err))} "
                                          "(fix the row, or set on_error = \"skip\")")
                    skipped[err.reason] += 1
                    continue
                reason = filtered_out({c: out[c][j] for c in out}, o)
                if reason is not None:
                    skipped[reason] += 1
                    continue
                keep.append(j)
            if skipped:
                log.info("%s: skipped so far: %s", prefix, dict(skipped))
            kept = {c: [v[j] for j in keep] for c, v in out.items()}
            for name in o.keep:
                kept[name] = [batch[name][j] for j in keep]
            return kept

        images = first_row.get("images") is not None  # a stream of image rows (its first row tells)
        kinds = {k: v for k, v in F.features(kind).items() if images or k != "images"}
        feats = datasets.Features({**kinds, **{k: raw.features[k] for k in o.keep}}) \
            if raw.features is not None else datasets.Features(kinds)
        if o.limit is not None:  # before the conversion: a bad row after the limit is never read
            raw = raw.take(o.limit)
        rows = raw.map(convert, batched=True, batch_size=MAP_BATCH, with_indices=True,
                       remove_columns=list(raw.column_names or first), features=feats)
        self.stats = {"source": self.name, "kind": kind, "streaming": True,
                      "files": [{"path": _shown(f, ctx)} for f in files]}
        ctx.reporter.info(f"data [bold]{ctx.name}[/]: streaming {kind.replace('_', ' ')} rows from {shown}")
        return rows

    def _read(self, path: Path, ctx: Any) -> Unit:
        raise NotImplementedError

    def _units(self, ctx: Any) -> Iterator[Unit]:
        for path in self.options.path:
            shown = _shown(path, ctx)
            try:
                size = path.stat().st_size
            except OSError as exc:
                raise FtcoreError(f"data.{ctx.name}: {shown}: cannot read: {exc.strerror}") from None
            if size == 0:
                raise FtcoreError(f"data.{ctx.name}: {shown}: empty file")
            unit = self._read(path, ctx)
            unit.path = path
            yield unit



# -- helpers ------------------------------------------------------------------------------------------

def streaming_problems(source: Any, plan: Any) -> list[str]:
    """What ``streaming = true`` cannot do, for the plan's ``[data.*]`` entry of ``source``."""
    o = source.options
    name = next((n for n, sel in plan.data.items() if sel.options is o), None)
    problems = []
    if source.stream_builder is None:
        problems.append(f"streaming: source '{source.name}' cannot stream; jsonl, json, csv and parquet can")
    if o.dedup != "none":
        problems.append("dedup: needs the whole data at once, which streaming never holds; set streaming = false "
                        "(the data is then prepared once, in shards on disk), or dedup the files beforehand")
    if o.validation is not None:
        problems.append("validation: a streaming source has no held-out split; give the stage an eval_data "
                        "that does not stream")
    users = [f"stage '{s.name}' eval_data" for s in plan.stages if s.eval_data and s.eval_data.split(":")[0] == name]
    users += [f"evaluation '{e.name}'" for e in plan.evaluations if e.data and e.data.split(":")[0] == name]
    users += [f"data.{n} (a mix)" for n, sel in plan.data.items()
              if name in {str(r).split(":")[0] for r in (getattr(sel.options, "sources", None) or {})}]
    if users:
        problems.append(f"streaming: only a stage's training data can stream; {', '.join(users)} reads it "
                        "whole: give it data that does not stream")
    return problems


def load_files(builder: str, path: Path, **kwargs: Any) -> Any:
    """A file read by a 🤗 datasets ``builder`` ("json", "csv", ...) into its Arrow cache,
    memory-mapped, in record batches of :data:`ARROW_BATCH_ROWS` rows."""
    import datasets

    return datasets.load_dataset(builder, data_files=[str(path)], split="train", writer_batch_size=ARROW_BATCH_ROWS,
                                 **kwargs)


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """No progress bars or info logs from datasets: the source reports for itself."""
    import datasets
    from datasets.utils import logging as dlog

    bars = datasets.is_progress_bar_enabled()
    level = dlog.get_verbosity()
    datasets.disable_progress_bars()
    dlog.set_verbosity(dlog.CRITICAL)  # its "Failed to read ..." errors are handled here
    try:
        yield
    finally:
        dlog.set_verbosity(level)
        if bars:
            datasets.enable_progress_bars()


@functools.lru_cache(maxsize=1)
def _code_hash() -> str:
    import hashlib

    h = hashlib.sha256()
    for module in (F, sys.modules[__name__]):  # the code that turns files into rows
        h.update(Path(module.__file__).read_bytes())
    return h.hexdigest()


def _fingerprint(*parts: Any) -> str:
    import hashlib

    return hashlib.sha256(json.dumps([_code_hash(), *parts], default=str).encode()).hexdigest()[:32]


def _num_proc(num_proc: int | None, n: int) -> int | None:
    if not num_proc or num_proc <= 1:
        return None
    return max(1, min(num_proc, n // MAP_BATCH or 1)) if n else None


def _iter_rows(unit: Unit) -> Iterator[dict]:
    if unit.dataset is not None:
        for batch in unit.dataset.iter(batch_size=64):
            keys = list(batch)
            for i in range(len(batch[keys[0]]) if keys else 0):
                yield {k: batch[k][i] for k in keys}
    else:
        yield from unit.rows or []


def placeholder_warning(count: int, first: str) -> str:
    return (f"{count:,} row(s) hold unfilled template placeholders, trained as they are (first: {first}); set "
            "placeholders = \"error\" to reject them or \"allow\" to silence this")


def _count_placeholders(ds: Any, unit: Unit, found: list) -> Any:
    """Count the rows ``__placeholder`` marks into ``found`` (and locate the first); drop the column."""
    import pyarrow.compute as pc

    col = ds.data.column(F.PLACEHOLDER_COLUMN)
    n = len(col) - col.null_count
    if n:
        if found[1] is None:
            first = int(pc.index(pc.is_valid(col), True).as_py())
            found[1] = f"{unit.locate([first])[first]}: {col[first].as_py()}"
        found[0] += n
    return ds.remove_columns(F.PLACEHOLDER_COLUMN)


def _split_errors(ds: Any) -> tuple[Any, list[tuple[int, F.RowError]]]:
    """Drop the rows that carry an error; return them as (index, error), in order."""
    import numpy as np
    import pyarrow.compute as pc

    col = ds.data.column(F.ERROR_COLUMN)
    if col.null_count == len(col):
        return ds, []
    valid = pc.is_valid(col).to_numpy(zero_copy_only=False)
    bad = np.flatnonzero(valid)
    values = pc.filter(col, pc.is_valid(col)).to_pylist()
    errors = [(int(i), F.RowError.decode(v)) for i, v in zip(bad, values)]
    return ds.select(np.flatnonzero(~valid)), errors


def _value_counts(ds: Any, column: str) -> dict[str, int]:
    import pyarrow.compute as pc

    counts = pc.value_counts(ds.data.column(column)).to_pylist()
    return {str(v["values"]): int(v["counts"]) for v in counts if v["values"] is not None}


MESSAGE_COLUMNS_OF = {"chat": ("messages",), "preference": ("prompt", "chosen", "rejected"),
                      "unpaired_preference": ("prompt", "completion")}


def _prune(ds: Any, kind: str, num_proc: int | None) -> Any:
    """Drop what no row uses: chat's ``tools`` column and the messages' ``tool_calls``, ``name``
    and ``reasoning_content`` keys, so a plain conversation is ``{"role", "content"}`` and nothing more."""
    import datasets
    import pyarrow.compute as pc

    if kind == "chat" and ds.data.column("tools").null_count == len(ds.data):
        ds = ds.remove_columns("tools")
    if kind in ("chat", "preference") and ds.data.column("images").null_count == len(ds.data):
        ds = ds.remove_columns("images")
    cols = MESSAGE_COLUMNS_OF.get(kind, ())
    if not cols:
        return ds
    optional = [k for k in F.MESSAGE_KEYS if k not in ("role", "content")]
    used = set()
    for c in cols:
        flat = pc.list_flatten(ds.data.column(c))
        for key in optional:
            if key not in used and len(flat) and pc.struct_field(flat, key).null_count < len(flat):
                used.add(key)
    if used == set(optional):
        return ds
    keys = [k for k in F.MESSAGE_KEYS if k in ("role", "content") or k in used]
    feats = datasets.Features({**ds.features, **{c: F.features(kind, keys)[c] for c in cols}})
    return ds.with_format("arrow").map(functools.partial(_drop_message_keys, cols=cols, keys=keys), batched=True,
                                       batch_size=ARROW_BATCH_ROWS, writer_batch_size=ARROW_BATCH_ROWS,
                                       features=feats, num_proc=_num_proc(num_proc, len(ds)),
                                       new_fingerprint=_fingerprint(ds._fingerprint, "prune", cols, keys),
                                       desc="prune").with_format(None)


def _base(unit: Unit) -> str | None:
    """The folder image paths in the unit's rows are relative to: its file's."""
    return str(unit.path.parent) if unit.path is not None else None


def _convert_batch(batch: dict[str, list], **options: Any) -> dict[str, list]:
    ARROW_PAGES.check()  # the map's pass reads a memory-mapped file
    return F.convert_batch(batch, **options)


def _drop_message_keys(table: Any, cols: tuple[str, ...], keys: list[str]) -> Any:
    import pyarrow as pa
    import pyarrow.compute as pc

    ARROW_PAGES.check()  # the map's pass reads a memory-mapped file
    for c in cols:
        col = table.column(c).combine_chunks()
        items = col.flatten()  # the structs of the rows in this batch
        children = dict(zip([f.name for f in items.type], items.flatten()))
        new_items = pa.StructArray.from_arrays([children[k] for k in keys], names=keys)
        offsets = pc.subtract(col.offsets, col.offsets[0])
        new_col = pa.ListArray.from_arrays(offsets, new_items, mask=col.is_null())
        table = table.set_column(table.schema.get_field_index(c), c, new_col)
    return table


def _shown(path: Path, ctx: Any) -> str:
    """A path as messages show it: relative to the plan's folder when inside it."""
    plan = getattr(getattr(ctx, "run", None), "plan", None)
    base = getattr(plan, "base_dir", None)
    if base is not None:
        try:
            return str(Path(path).relative_to(Path(base).resolve()))
        except ValueError:
            pass
    return str(path)


def _one_line(text: str) -> str:
    return " ".join(str(text).split()) if "\n" in str(text) else str(text)


def _first_line(exc: BaseException) -> str:
    text = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# -- reading files when datasets cannot: exact places ------------------------------------------------

def _decode_error(data: bytes, exc: UnicodeDecodeError, shown: str) -> str:
    line = data.count(b"\n", 0, exc.start) + 1
    col = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
    return f"{shown}:{line}: not UTF-8 text ({exc.reason}: byte 0x{data[exc.start]:02x} at column {col}); " \
           "save the file as UTF-8"


def _strip_bom(data: bytes) -> bytes:
    return data[len(codecs.BOM_UTF8):] if data.startswith(codecs.BOM_UTF8) else data


def json_array_lines(text: str, limit: int | None = None) -> tuple[list[Any], list[int]]:
    """Parse a JSON array, returning its elements and the line each starts on (with ``limit``, its
    first ``limit`` elements: the rest is not read). Raises ``json.JSONDecodeError`` with the exact
    place of the first problem."""
    dec = json.JSONDecoder()
    ws = " \t\n\r"
    n = len(text)
    pos = 0
    while pos < n and text[pos] in ws:
        pos += 1
    if pos >= n or text[pos] != "[":
        raise json.JSONDecodeError("Expecting '['", text, pos)
    pos += 1
    values, lines = [], []
    line, counted = 1, 0

    def skip(p: int) -> int:
        while p < n and text[p] in ws:
            p += 1
        return p

    pos = skip(pos)
    if pos < n and text[pos] == "]":
        end = skip(pos + 1)
        if end != n:
            raise json.JSONDecodeError("Extra data", text, end)
        return values, lines
    while True:
        pos = skip(pos)
        line += text.count("\n", counted, pos)
        counted = pos
        value, pos = dec.raw_decode(text, pos) if pos < n else (None, -1)
        if pos < 0:
            raise json.JSONDecodeError("Expecting value", text, n)
        values.append(value)
        lines.append(line)
        if limit is not None and len(values) >= limit:
            return values, lines
        pos = skip(pos)
        if pos < n and text[pos] == ",":
            pos += 1
            continue
        if pos < n and text[pos] == "]":
            end = skip(pos + 1)
            if end != n:
                raise json.JSONDecodeError("Extra data", text, end)
            return values, lines
        raise json.JSONDecodeError("Expecting ',' delimiter", text, pos)


def _json_error(shown: str, exc: json.JSONDecodeError, text: str | None = None, line: int | None = None) -> str:
    where = f"{shown}:{line if line is not None else exc.lineno}"
    hint = ""
    if text is not None and text.lstrip().startswith("[") and not text.rstrip().endswith("]"):
        hint = " (the file ends before the array's closing ']': is it truncated?)"
    return f"{where}: invalid JSON: {exc.msg} (column {exc.colno}){hint}"


def read_json_python(path: Path, shown: str, skip: bool, limit: int | None = None) -> Unit:
    """Read a JSON array or JSON Lines file in Python, line by line, for exact errors. With ``limit``,
    at most that many rows (rejected ones count): JSON Lines are read no further than that.
    The elements of an array written on one line are numbered by index (``file: row 5``)."""
    unit = Unit(shown)
    with path.open("rb") as fh:
        start = _strip_bom(fh.read(1 << 16))
        head = start.lstrip()[:1]
    if not head and len(start) < (1 << 16) - len(codecs.BOM_UTF8):
        raise FtcoreError(f"{shown}: empty file")
    if head == b"[" or not head:
        data = _strip_bom(path.read_bytes())
        if not data.strip():
            raise FtcoreError(f"{shown}: empty file")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise FtcoreError(_decode_error(data, exc, shown)) from None
        try:
            values, lines = json_array_lines(text, limit)
        except json.JSONDecodeError as exc:
            raise FtcoreError(_json_error(shown, exc, text)) from None
        places = _array_places(shown, lines)
        rows, kept = [], []
        for k, value in enumerate(values):
            if _is_object(value, places[k], unit, skip):
                rows.append(value)
                kept.append(k)
        unit.rows = rows
        if len(set(lines)) == len(lines):
            unit.lines = [lines[k] for k in kept]
        else:
            unit.locate_many = lambda indices: {i: places[kept[i]] for i in indices}
        return unit
    if head == b"{":
        single = _one_object(path, start)
        if single is not None:
            unit.rows, unit.lines = [single], [1]
            return unit
    rows, row_lines = [], []
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            if limit is not None and len(rows) + len(unit.rejected) >= limit:
                break
            if lineno == 1:
                raw = _strip_bom(raw)
            if not raw.strip():
                continue
            line = _decode_line(raw[:-1] if raw.endswith(b"\n") else raw, lineno, shown, unit, skip)
            if line is None:
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                message = f"invalid JSON: {exc.msg} (column {exc.colno})"
                if not skip:
                    raise FtcoreError(f"{shown}:{lineno}: {message}") from None
                unit.rejected.append((f"{shown}:{lineno}", F.RowError(message, "invalid_json")))
                continue
            if not _is_object(value, f"{shown}:{lineno}", unit, skip):
                continue
            rows.append(value)
            row_lines.append(lineno)
    unit.rows, unit.lines = rows, row_lines
    return unit


def _array_places(shown: str, lines: list[int]) -> list[str]:
    """Where each element of a JSON array is: ``file:line`` when each starts on a line of its own,
    else ``file: row n`` (an array written on one line would put every row at ``:1``)."""
    if len(set(lines)) == len(lines):
        return [f"{shown}:{line}" for line in lines]
    return [f"{shown}: row {k + 1}" for k in range(len(lines))]


def _one_object(path: Path, start: bytes) -> dict | None:
    """The file's one JSON object written over several lines (a pretty-printed row), or None."""
    first = start.split(b"\n", 1)[0]
    try:
        json.loads(first)
        return None  # the first line is a whole row: JSON Lines
    except (UnicodeDecodeError, json.JSONDecodeError):
        pass
    try:
        value = json.loads(_strip_bom(path.read_bytes()).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None


def _decode_line(raw: bytes, lineno: int, shown: str, unit: Unit, skip: bool) -> str | None:
    """One line as text; a line that is not UTF-8 is an error naming where, or rejected when skipping."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        message = (f"{shown}:{lineno}: not UTF-8 text ({exc.reason}: byte 0x{raw[exc.start]:02x} at column "
                   f"{exc.start + 1}); save the file as UTF-8")
        if not skip:
            raise FtcoreError(message) from None
        unit.rejected.append((f"{shown}:{lineno}", F.RowError(message.split(": ", 1)[1], "not_utf8")))
        return None


def _is_object(value: Any, where: str, unit: Unit, skip: bool) -> bool:
    """A JSON row must be an object; anything else is an error, or rejected when skipping."""
    if isinstance(value, dict):
        return True
    err = F.RowError(f"expected a JSON object, got {F._kind_of_value(value)}", "wrong_type")
    if not skip:
        raise FtcoreError(f"{where}: {err}")
    unit.rejected.append((where, err))
    return False


def json_locator(path: Path, shown: str) -> Callable[[list[int]], dict[int, str]]:
    """Row index -> ``file:line`` for a file datasets read (JSON Lines skip blank lines)."""

    def locate(indices: list[int]) -> dict[int, str]:
        data = _strip_bom(path.read_bytes())
        wanted = set(indices)
        found: dict[int, str] = {}
        if data.lstrip()[:1] == b"[":
            try:
                _, lines = json_array_lines(data.decode("utf-8"))
                places = _array_places(shown, lines)
                return {i: places[i] if i < len(places) else f"{shown}: row {i + 1}" for i in indices}
            except (ValueError, UnicodeDecodeError):
                return {i: f"{shown}: row {i + 1}" for i in indices}
        row = -1
        for lineno, raw in enumerate(data.split(b"\n"), 1):
            if raw.strip():
                row += 1
                if row in wanted:
                    found[row] = f"{shown}:{lineno}"
                    if len(found) == len(wanted):
                        break
        return {i: found.get(i, f"{shown}: row {i + 1}") for i in indices}

    return locate


def csv_header(path: Path, delimiter: str = ",") -> list[str] | None:
    """The header row, or None when the file cannot be read as UTF-8 CSV."""
    try:
        with path.open(encoding="utf-8-sig", newline="") as fh:
            return next(csv.reader(fh, delimiter=delimiter), None)
    except (UnicodeDecodeError, csv.Error, OSError):
        return None


def read_csv_python(path: Path, shown: str, skip: bool, delimiter: str = ",", limit: int | None = None) -> Unit:
    """Read a CSV file in Python for exact errors: rows are counted after the header, blank
    lines not counted (as pandas does); a row with more fields than the header is bad. With
    ``limit``, at most that many rows (rejected ones count) are read."""
    data = _strip_bom(path.read_bytes())
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FtcoreError(_decode_error(data, exc, shown)) from None
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter)
    try:
        header = next(reader, None)
    except csv.Error as exc:
        raise FtcoreError(f"{shown}:1: bad CSV header: {exc}") from None
    if not header:
        raise FtcoreError(f"{shown}: empty file (no header row)")
    unit = Unit(shown, strings=True)
    rows: list[dict] = []
    rowno, prev_line = 0, reader.line_num
    row_numbers: list[int] = []
    while limit is None or len(rows) + len(unit.rejected) < limit:
        try:
            rec = next(reader)
        except StopIteration:
            break
        except csv.Error as exc:
            rowno += 1
            err = F.RowError(f"bad CSV: {exc}", "bad_csv_row")
            where = f"{shown}: row {rowno} (line {prev_line + 1})"
            if not skip:
                raise FtcoreError(f"{where}: {err}") from None
            unit.rejected.append((where, err))
            prev_line = reader.line_num
            continue
        start, prev_line = prev_line + 1, reader.line_num
        if not rec:
            continue
        rowno += 1
        if len(rec) > len(header):
            err = F.RowError(f"expected {len(header)} fields (as in the header: {', '.join(header)}), got "
                             f"{len(rec)}; quote values that contain commas", "bad_csv_row")
            where = f"{shown}: row {rowno} (line {start})"
            if not skip:
                raise FtcoreError(f"{where}: {err}")
            unit.rejected.append((where, err))
            continue
        rec = rec + [""] * (len(header) - len(rec))
        rows.append({h: (v if v != "" else None) for h, v in zip(header, rec)})
        row_numbers.append(rowno)
    unit.rows = rows
    unit.locate_many = lambda indices: {i: f"{shown}: row {row_numbers[i]}" for i in indices}
    return unit


def read_text_python(path: Path, shown: str, unit_by: str, skip: bool, limit: int | None = None) -> Unit:
    """A text file's rows in Python (each file, or each line, one row), for exact errors; with
    ``limit``, lines are read no further than that many rows."""
    unit = Unit(shown)
    if unit_by == "line":
        rows, lines = [], []
        with path.open("rb") as fh:
            for lineno, raw in enumerate(fh, 1):
                if limit is not None and len(rows) + len(unit.rejected) >= limit:
                    break
                line = _decode_line(_strip_bom(raw) if lineno == 1 else raw, lineno, shown, unit, skip)
                if line is not None:
                    rows.append({"text": line.rstrip("\n").rstrip("\r")})
                    lines.append(lineno)
        unit.rows, unit.lines = rows, lines
        return unit
    data = _strip_bom(path.read_bytes())
    if unit_by == "file":
        try:
            unit.rows, unit.lines = [{"text": data.decode("utf-8")}], [1]
        except UnicodeDecodeError as exc:
            if not skip:
                raise FtcoreError(_decode_error(data, exc, shown)) from None
            unit.rejected.append((shown, F.RowError(_decode_error(data, exc, shown).split(": ", 1)[1], "not_utf8")))
            unit.rows, unit.lines = [], []
    return unit


def hub_reachable(timeout: float = 3.0) -> str | None:
    """None when the hub's host (or the proxy in between) accepts a connection, else why not:
    one short try instead of minutes of retries."""
    import os
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    target, host, port = constants.ENDPOINT, url.hostname or "huggingface.co", url.port or \
        (443 if url.scheme == "https" else 80)
    names = ("https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY") if url.scheme == "https" else \
        ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY")
    no_proxy = os.environ.get("no_proxy") or os.environ.get("NO_PROXY") or ""
    proxy = next((os.environ[n] for n in names if os.environ.get(n)), None)
    if proxy and not any(host.endswith(d.strip().lstrip(".")) for d in no_proxy.split(",") if d.strip()):
        purl = urlparse(proxy if "://" in proxy else f"http://{proxy}")
        target, host, port = f"the proxy {proxy}", purl.hostname or host, purl.port or 8080
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as exc:
        return f"cannot reach {target} ({exc.strerror or exc})"
