"""Data source ``json``: a JSON array of objects, or JSON Lines (one object per line), in any format."""

from __future__ import annotations

import logging
from pathlib import Path

import ftcore

from ftcore_plugins.common.prepare import ARROW_PAGES
from ftcore_plugins.data._source import (SMALL_LIMIT, FileSource, Unit, _first_line, _shown, json_locator,
                                         load_files, read_json_python)

log = logging.getLogger("ftcore")


def read_json(path: Path, shown: str, skip: bool, limit: int | None = None) -> Unit:
    """Through datasets (memory-mapped Arrow, cached); when it cannot read the file, in
    Python line by line, to report (or, with skip, drop) exactly the bad lines. With ``limit``
    (the source's rows left to read), the Python reader reads no further than that: at once for a
    small limit (a sample of a big file), else when datasets cannot read the whole file."""
    if limit is not None and limit <= SMALL_LIMIT:
        return read_json_python(path, shown, skip, limit)
    try:
        ds = load_files("json", path, parse_agent_traces=False)
        for batch in ds.data.table.to_batches():  # batch by batch: the pages read are handed back
            batch.validate(full=True)  # pyarrow's JSON reader lets invalid UTF-8 through
            ARROW_PAGES.check()
    except Exception as exc:  # no line numbers in datasets' errors: find the place ourselves
        log.debug("datasets could not read %s (%s); reading it line by line", path, _first_line(exc))
        return read_json_python(path, shown, skip, limit)
    return Unit(shown, dataset=ds, locate_many=json_locator(path, shown))


class JsonSource(FileSource):
    """JSON arrays or JSON Lines files, any row format."""

    name = "json"
    stream_builder = "json"

    def _read(self, path, ctx):
        return read_json(path, _shown(path, ctx), self.options.on_error == "skip", self.row_budget)


@ftcore.hookimpl
def register_data_sources(register):
    register(JsonSource)
