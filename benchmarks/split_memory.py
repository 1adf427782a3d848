"""Memory of filtering and the validation split over a memory-mapped corpus.

    python benchmarks/split_memory.py [--rows 2000000] [--tiny]

A ``datasets`` folder of short distinct rows, loaded memory-mapped and read through once (its
pages resident, as after a source's reading), then ``clean_and_split`` with ``validation = 0.1``
(the default filters and duplicate count, then a seeded random split). Measured between
``ftcore.memory.snapshot()`` calls: the peak RSS above the RSS before, and the RSS once the two
sides are returned, against before (negative when the passes hand back the data's pages read
before the call). Run it with an older ``plugins/data/_quality.py`` for the before.

``--tiny`` (the test's mode): 20,000 rows.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from _bench import machine  # noqa: E402


def measure(rows: int, work: Path) -> dict:
    import datasets

    from ftcore import memory
    from ftcore_plugins.data._quality import QualityOptions, clean_and_split

    datasets.Dataset.from_dict({"text": [f"row number {i} of the corpus" for i in range(rows)]}).save_to_disk(
        work / "rows")
    data = datasets.load_from_disk(work / "rows")
    for _ in data.iter(batch_size=100_000):
        pass
    memory.reset_peak()
    before = memory.snapshot()["rss_mib"]
    start = time.perf_counter()
    stats: dict = {}
    parts = clean_and_split(data, QualityOptions(validation=0.1), stats, "data.split")
    seconds = time.perf_counter() - start
    after = memory.snapshot()
    return {"rows": rows, "train": len(parts["train"]), "validation": len(parts["validation"]),
            "peak_above_mib": after["peak_rss_mib"] - before, "held_mib": after["rss_mib"] - before,
            "seconds": seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--tiny", action="store_true", help="20,000 rows (the test's mode)")
    p.add_argument("--json", type=Path, help="also write the result here")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="ftcore-split-memory-") as work:  # the filters' indices go there too
        r = measure(20_000 if a.tiny else a.rows, Path(work))
    print(f"machine: {machine()}")
    print("| rows | train | validation | peak above start (MiB) | held after (MiB) | seconds |")
    print("|---:|---:|---:|---:|---:|---:|")
    print(f"| {r['rows']:,} | {r['train']:,} | {r['validation']:,} | {r['peak_above_mib']:.0f} | "
          f"{r['held_mib']:.0f} | {r['seconds']:.1f} |")
    if a.json:
        a.json.write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
