"""Data source ``jsonl``: JSON Lines (or a JSON array), in any format; the same reader as ``json``."""

from __future__ import annotations

import ftcore

from ftcore_plugins.data._source import FileSource, _shown
from ftcore_plugins.data.json import read_json


class JsonlSource(FileSource):
    """JSON Lines (or JSON array) files, any row format; the same reader as json."""

    name = "jsonl"
    stream_builder = "json"

    def _read(self, path, ctx):
        return read_json(path, _shown(path, ctx), self.options.on_error == "skip", self.row_budget)


@ftcore.hookimpl
def register_data_sources(register):
    register(JsonlSource)
