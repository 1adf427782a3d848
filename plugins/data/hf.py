"""Data source ``hf``: a dataset on the Hugging Face Hub (or in its local cache), in any format."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

import ftcore
from ftcore.errors import FtcoreError

from ftcore_plugins.common.prepare import ARROW_BATCH_ROWS
from ftcore_plugins.data._source import RowOptions, RowSource, Unit, _first_line, _rows_of, hub_reachable


class HubSource(RowSource):
    """A Hugging Face Hub dataset (or one in the local cache), any row format.

    A hub id (`org/name`), with an optional config `name`, `split` and `revision`. Offline
    (HF_HUB_OFFLINE=1) it is read from the local cache, or fails at once saying so."""

    name = "hf"

    class Options(RowOptions):
        path: Annotated[str, Field(min_length=1)]
        name: str | None = None
        split: str = "train"
        revision: str | None = None
        token: str | None = None

    def _units(self, ctx):
        import datasets
        from huggingface_hub import constants

        o = self.options
        label = f"hub:{o.path}" + (f"/{o.name}" if o.name else "")
        offline = bool(constants.HF_HUB_OFFLINE or datasets.config.HF_HUB_OFFLINE)
        if not offline:
            why = hub_reachable()
            if why is not None:  # fail now rather than after minutes of retries
                raise FtcoreError(f"hub dataset {o.path!r}: {why}: no network? If the dataset is in the local cache, "
                                  "set HF_HUB_OFFLINE=1 to read it from there")
        try:
            ds = datasets.load_dataset(o.path, o.name, split=o.split, revision=o.revision, token=o.token,
                                       num_proc=o.num_proc, writer_batch_size=ARROW_BATCH_ROWS,
                                       download_config=datasets.DownloadConfig(max_retries=1, token=o.token))
        except Exception as exc:
            if offline:
                raise FtcoreError(f"hub dataset {o.path!r} is not in the local cache, and HF_HUB_OFFLINE=1 forbids "
                                  f"downloading it: run once with network access, or use a file source "
                                  f"({_first_line(exc)})") from None
            if isinstance(exc, (ConnectionError, TimeoutError)):
                raise FtcoreError(f"hub dataset {o.path!r}: cannot download it: no network? "
                                  f"({_first_line(exc)})") from None
            raise FtcoreError(f"cannot load hub dataset {o.path!r}: {_first_line(exc)}") from None
        if not isinstance(ds, datasets.Dataset):
            raise FtcoreError(f"hub dataset {o.path!r}: split {o.split!r} is not a single dataset "
                              f"({type(ds).__name__})")
        yield Unit(f"{label}[{o.split}]", dataset=ds, locate_many=_rows_of(f"{label}[{o.split}]"))


@ftcore.hookimpl
def register_data_sources(register):
    register(HubSource)
