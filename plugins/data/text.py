"""Data source ``text``: plain text files, one document per file or per line."""

from __future__ import annotations

import logging
from typing import Annotated, Literal

from pydantic import Field

import ftcore
from ftcore_plugins.data._quality import QualityOptions
from ftcore_plugins.data._source import (SMALL_LIMIT, FileSource, Paths, Unit, _first_line, _shown, load_files,
                                         read_text_python)

log = logging.getLogger("ftcore")


class TextSource(FileSource):
    """Plain UTF-8 text files for pre-training: one document per file or per line.

    Each file is a document (`unit = "file"`) or each non-blank line is (`unit = "line"`).
    Rows have the one column `text`."""

    name = "text"
    silent_skips = ("empty_text",)  # blank lines and empty files: counted, not warned about

    class Options(QualityOptions):  # filters, dedup and splits, as every source has
        path: Paths
        unit: Literal["file", "line"] = "file"
        on_error: Literal["error", "skip"] = "error"
        limit: Annotated[int, Field(ge=1)] | None = None
        num_proc: Annotated[int, Field(ge=1)] | None = None

    def _fixed_format(self) -> str:
        return "text"

    def _read(self, path, ctx):
        shown = _shown(path, ctx)
        by = self.options.unit
        budget = self.row_budget if by == "line" else None
        if budget is not None and budget <= SMALL_LIMIT:  # a sample: read no further than `limit`
            return read_text_python(path, shown, by, self.options.on_error == "skip", budget)
        try:
            ds = load_files("text", path, sample_by="document" if by == "file" else "line")
        except Exception as exc:
            log.debug("datasets could not read %s (%s); reading it line by line", path, _first_line(exc))
            return read_text_python(path, shown, by, self.options.on_error == "skip", budget)
        if by == "file":
            return Unit(shown, dataset=ds, locate_many=lambda idx: {i: shown for i in idx})
        return Unit(shown, dataset=ds, locate_many=lambda idx: {i: f"{shown}:{i + 1}" for i in idx})



@ftcore.hookimpl
def register_data_sources(register):
    register(TextSource)
