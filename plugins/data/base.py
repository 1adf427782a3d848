"""The public base for a third-party file data source: ``ftcore_plugins.data.base``.

Subclass :class:`FileSource`, set ``name``, and implement one method, ``read_rows(path)``,
that yields the file's raw rows as dicts. The base does the rest, as for the built-in
``jsonl``, ``csv`` and ``text`` sources:

* ``path`` (a file, a glob or a list of them, relative to the plan), recorded in the run
  manifest through ``inputs()``;
* conversion from any supported row format (``format``, ``columns``, ``keep``) to the
  internal schema;
* ``on_error = "error" | "skip"``, with every bad row reported as ``file:line`` when
  ``read_rows`` gives line numbers, else ``file: row n``;
* ``placeholders = "warn" | "error" | "allow"``: message text still holding a template
  slot such as ``{{name}}`` is warned about once, rejected as a bad row, or let through;
* ``limit`` (``read_rows`` is not asked for a row past it), the filters (``min_chars``,
  ``max_chars``, ``drop_non_text``), ``dedup`` and a
  ``validation`` split (``split_strategy``, ``split_by``, ``seed``);
* as evaluation data, the rows whose prompt repeats a training row's counted, warned about and,
  with ``train_overlap = "drop"``, left out (docs/data.md, "Train/evaluation overlap");
* the data report: the base sets ``self.stats`` (rows read, kept, skipped per reason,
  dropped by each filter); a subclass does not.

``read_rows`` yields, for each row of the file, one of:

* ``row``: a dict of the row's fields (then messages say ``file: row n``);
* ``(line, row)``: the row and the 1-based line it starts on (then ``file:line``);
* ``BadRow(message, line)``: a row that cannot be read (a wrong field count, say). With
  ``on_error = "error"`` it stops loading with ``data.<name>: <file>:<line>: <message>``;
  with ``"skip"`` it is counted and left out.

Import heavy libraries inside ``read_rows``. Values that arrive as text (a TSV or CSV
field) may set ``strings = True`` on the class, so ``label`` can be ``"true"``/``"false"``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ftcore.errors import FtcoreError

from ftcore_plugins.common import formats as F
from ftcore_plugins.data._source import FileOptions, Unit, _shown
from ftcore_plugins.data._source import FileSource as _FileSource

__all__ = ["BadRow", "FileOptions", "FileSource"]


@dataclass(frozen=True)
class BadRow:
    """A row ``read_rows`` could not read: reported (or skipped) at ``line``."""

    message: str
    line: int | None = None
    reason: str = "bad_row"  # how the data report counts it


class FileSource(_FileSource):
    """Base for a data source that reads files row by row: implement ``read_rows(path)``.

    ``Options`` is :class:`FileOptions` (``path`` and every shared option); subclass it to
    add your own, as ``class Options(FileOptions): delimiter: str = "\\t"``.
    """

    Options = FileOptions
    strings: ClassVar[bool] = False  # every value arrives as text (TSV, CSV)

    def read_rows(self, path: Path) -> Iterator[dict | tuple[int, dict] | BadRow]:
        raise NotImplementedError(f"data source '{self.name}' must implement read_rows(path)")

    def _read(self, path: Path, ctx: Any) -> Unit:
        shown = _shown(path, ctx)
        skip = self.options.on_error == "skip"
        unit = Unit(shown, strings=self.strings)
        rows: list[dict] = []
        lines: list[int | None] = []
        budget = self.row_budget  # `limit`: the rows left to read; read_rows is not asked for more
        for n, item in enumerate(self.read_rows(path), 1):
            if isinstance(item, BadRow):
                where = f"{shown}:{item.line}" if item.line is not None else f"{shown}: row {n}"
                if not skip:
                    raise FtcoreError(f"{where}: {item.message}")
                unit.rejected.append((where, F.RowError(item.message, item.reason)))
            else:
                line, row = item if isinstance(item, tuple) else (None, item)
                if not isinstance(row, dict):
                    raise FtcoreError(f"{shown}: data source '{self.name}' yielded {type(row).__name__}, not a "
                                      "dict (read_rows yields row, (line, row) or BadRow)")
                rows.append(row)
                lines.append(line)
            if budget is not None and len(rows) + len(unit.rejected) >= budget:
                break  # the generator is not asked for the next row: nothing after the limit is read
        unit.rows = rows
        if rows and all(line is not None for line in lines):
            unit.lines = lines  # exact file:line in every message
        return unit
