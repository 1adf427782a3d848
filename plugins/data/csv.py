"""Data source ``csv``: comma- (or otherwise-) separated values with a header row."""

from __future__ import annotations

import logging
from typing import Annotated

from pydantic import Field

import ftcore
from ftcore.errors import FtcoreError

from ftcore_plugins.data._source import (SMALL_LIMIT, FileOptions, FileSource, Unit, _first_line, _rows_of, _shown,
                                         csv_header, load_files, read_csv_python)

log = logging.getLogger("ftcore")


class CsvSource(FileSource):
    """CSV files with a header row, any row format.

    Every value is read as a string (a `label` column may be true/false). Rows are numbered
    from 1 after the header."""

    name = "csv"

    stream_builder = "csv"

    class Options(FileOptions):
        delimiter: Annotated[str, Field(min_length=1, max_length=1)] = ","

    def stream_kwargs(self, path):
        import datasets

        header = csv_header(path, self.options.delimiter) or []
        return {"sep": self.options.delimiter,
                "features": datasets.Features({h: datasets.Value("string") for h in header})}

    def _read(self, path, ctx):
        import datasets

        shown, sep = _shown(path, ctx), self.options.delimiter
        skip = self.options.on_error == "skip"
        header = csv_header(path, sep)
        budget = self.row_budget
        if header is None or (budget is not None and budget <= SMALL_LIMIT):  # not UTF-8 or CSV; or a sample
            return read_csv_python(path, shown, skip, sep, budget)
        dupes = sorted({h for h in header if header.count(h) > 1})
        if dupes:
            raise FtcoreError(f"{shown}:1: the header names {', '.join(repr(d) for d in dupes)} more than once")
        features = datasets.Features({h: datasets.Value("string") for h in header})
        try:
            ds = load_files("csv", path, features=features, sep=sep)
        except Exception as exc:
            log.debug("datasets could not read %s (%s); reading it row by row", path, _first_line(exc))
            return read_csv_python(path, shown, skip, sep, budget)
        return Unit(shown, dataset=ds, strings=True, locate_many=_rows_of(shown))


@ftcore.hookimpl
def register_data_sources(register):
    register(CsvSource)
