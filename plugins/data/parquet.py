"""Data source ``parquet``: Apache Parquet files, in any format (nested message lists included)."""

from __future__ import annotations

import ftcore
from ftcore.errors import FtcoreError

from ftcore_plugins.data._source import FileSource, Unit, _first_line, _rows_of, _shown, load_files


class ParquetSource(FileSource):
    """Parquet files, any row format (nested message lists included)."""

    name = "parquet"
    stream_builder = "parquet"

    def _read(self, path, ctx):
        shown = _shown(path, ctx)
        try:
            ds = load_files("parquet", path)
        except Exception as exc:
            with path.open("rb") as fh:
                head = fh.read(4)
                fh.seek(max(0, path.stat().st_size - 4))
                tail = fh.read(4)
            if head != b"PAR1" or tail != b"PAR1":
                raise FtcoreError(f"{shown}: not a Parquet file (it does not begin and end with the 'PAR1' "
                                  "marker); is it another format, or cut short?") from None
            raise FtcoreError(f"{shown}: cannot read Parquet: {_first_line(exc)}") from None
        return Unit(shown, dataset=ds, locate_many=_rows_of(shown))


@ftcore.hookimpl
def register_data_sources(register):
    register(ParquetSource)
