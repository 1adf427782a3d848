"""Data source ``tsv``: tab-separated values with a header row."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

import ftcore
from ftcore_plugins.data.base import BadRow, FileOptions, FileSource


class TsvSource(FileSource):
    """Tab-separated files with a header row, any row format (instruction/output, prompt/completion, text, ...).

    Each line after the header is one row; a field may not contain a tab or a newline. Lines
    are numbered from 1, the header being line 1, so errors point at the line in an editor."""

    name = "tsv"
    strings = True  # every value arrives as text

    class Options(FileOptions):  # path, format, columns, on_error, limit, dedup, validation, ...
        delimiter: Annotated[str, Field(min_length=1, max_length=1)] = "\t"

    def read_rows(self, path):
        sep = self.options.delimiter
        with path.open(encoding="utf-8-sig", newline="") as fh:
            header = fh.readline().rstrip("\r\n").split(sep)
            if not any(header):
                yield BadRow("the first line must be a header naming the fields", 1)
                return
            for line, text in enumerate(fh, 2):
                text = text.rstrip("\r\n")
                if not text.strip():
                    continue
                values = text.split(sep)
                if len(values) != len(header):
                    yield BadRow(f"expected {len(header)} tab-separated fields (as in the header: "
                                 f"{', '.join(header)}), got {len(values)}", line, "bad_tsv_row")
                    continue
                yield line, {k: (v if v != "" else None) for k, v in zip(header, values)}


@ftcore.hookimpl
def register_data_sources(register):
    register(TsvSource)
