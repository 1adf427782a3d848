"""Data source ``arrow``: a folder written by ``datasets``' ``save_to_disk``, in any format."""

from __future__ import annotations

import ftcore
from ftcore.errors import FtcoreError
from ftcore.types import InputPath

from ftcore_plugins.data._source import RowOptions, RowSource, Unit, _first_line, _rows_of, _shown


class ArrowSource(RowSource):
    """A folder written by datasets' save_to_disk, memory-mapped as it is."""

    name = "arrow"

    class Options(RowOptions):
        path: InputPath
        split: str | None = None  # for a saved DatasetDict; default "train"

    def check(self, plan):
        if not self.options.path.is_dir():
            return super().check(plan) + [f"path: {self.options.path} is a file; the arrow source reads a folder "
                                          "written by Dataset.save_to_disk (use the json, csv or parquet source for "
                                          "a file)"]
        return super().check(plan)

    def inputs(self):
        return sorted(p for p in self.options.path.rglob("*") if p.is_file())

    def _units(self, ctx):
        import datasets

        path, shown = self.options.path, _shown(self.options.path, ctx)
        try:
            saved = datasets.load_from_disk(str(path))
        except Exception as exc:
            raise FtcoreError(f"{shown}: not a dataset folder written by save_to_disk ({_first_line(exc)})") from None
        if isinstance(saved, datasets.DatasetDict):
            split = self.options.split or "train"
            if split not in saved:
                raise FtcoreError(f"{shown}: no split {split!r}; it has {', '.join(saved)} (set split = \"...\")")
            saved, shown = saved[split], f"{shown}[{split}]"
        elif self.options.split is not None:
            raise FtcoreError(f"{shown}: split = {self.options.split!r} but the folder holds one dataset, not splits")
        yield Unit(shown, dataset=saved, locate_many=_rows_of(shown))


@ftcore.hookimpl
def register_data_sources(register):
    register(ArrowSource)
