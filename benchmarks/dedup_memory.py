"""Memory of deduplication per million rows: what exact and near (MinHash LSH) dedup hold.

    python benchmarks/dedup_memory.py [--rows 100000 250000 500000 1000000] [--tiny]

Each size runs in a process of its own, which makes its rows (C4-like: 30-120 words drawn from the
words of ../shared/fixtures/data/c4_demo.jsonl, so nearly every row is new) batch by batch, never
holding them, and puts them through what ``clean_and_split`` holds across a corpus: its
``ExactDuplicates`` (8-byte digests, found repeating by one sort at the end) and the masks of the
rows that pass and are kept, and for near dedup ftcore's ``NearDuplicates`` index as well. The
measures are the growth of the process's anonymous memory (RssAnon) from before the first row to
after the last, with every structure still alive, and its peak (VmHWM, the sort at the end included)
above the RSS before the first row: file-backed pages (the Arrow data a source maps) are not
counted, because they are the page cache's, not dedup's.

``--tiny`` (the test's mode): 5,000 and 10,000 rows.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from _bench import SHARED, machine, rss_anon  # noqa: E402

C4 = SHARED / "data" / "c4_demo.jsonl"


def words() -> list[str]:
    if C4.exists():
        text = " ".join(json.loads(line)["text"] for line in C4.read_text(encoding="utf-8").splitlines() if line)
        return sorted(set(text.split()))
    return [f"w{i}" for i in range(20_000)]


def arm(rows: int, kind: str) -> dict:
    import numpy as np

    from ftcore import memory
    from ftcore_plugins.data._quality import ExactDuplicates, NearDuplicates, normalized_text

    rng, vocab = random.Random(rows), words()
    before, rss_before = rss_anon(), memory.snapshot()["rss_mib"]
    memory.reset_peak()
    passed = np.zeros(rows, dtype=bool)  # by the filters, as clean_and_split holds it
    exact = ExactDuplicates(rows)
    near = NearDuplicates(0.7, seed=42) if kind == "near" else None
    near_new = np.zeros(rows, dtype=bool) if near is not None else None
    start = time.perf_counter()
    for first in range(0, rows, 10_000):
        texts = [normalized_text({"text": " ".join(rng.choices(vocab, k=rng.randint(30, 120)))})
                 for _ in range(min(10_000, rows - first))]
        passed[first:first + len(texts)] = True
        exact.add(texts)
        if near is not None:
            near_new[first:first + len(texts)] = near.new(texts)
    repeats = exact.repeats()
    keep = passed  # a mask over the rows, as clean_and_split keeps it
    if near is not None:
        keep = near_new
    else:
        keep[passed] = ~repeats
    seconds = time.perf_counter() - start
    grown = rss_anon() - before
    peak = (memory.snapshot()["peak_rss_mib"] - rss_before) * 2**20
    return {"rows": rows, "kind": kind, "kept": int(keep.sum()), "bytes": grown, "bytes_per_row": grown / rows,
            "peak_bytes": peak, "peak_bytes_per_row": peak / rows, "seconds": seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[100_000, 250_000, 500_000, 1_000_000])
    p.add_argument("--tiny", action="store_true", help="5,000 and 10,000 rows (the test's mode)")
    p.add_argument("--kinds", nargs="+", choices=["exact", "near"], default=["exact", "near"])
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--arm", nargs=2, metavar=("ROWS", "KIND"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.arm:
        print(json.dumps(arm(int(a.arm[0]), a.arm[1])))
        return
    results = []
    for rows in ([5_000, 10_000] if a.tiny else sorted(a.rows)):
        for kind in a.kinds:
            out = subprocess.run([sys.executable, __file__, "--arm", str(rows), kind], capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{kind} at {rows} rows failed:\n{out.stderr[-3000:]}")
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"machine: {machine()}")
    print("| rows | dedup | rows kept | memory held (MiB) | bytes a row | per million rows (GiB) | peak (MiB) | "
          "peak bytes a row | seconds |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['rows']:,} | {r['kind']} | {r['kept']:,} | {r['bytes'] / 2**20:.1f} | {r['bytes_per_row']:,.0f} | "
              f"{r['bytes_per_row'] * 1e6 / 2**30:.2f} | {r['peak_bytes'] / 2**20:.1f} | "
              f"{r['peak_bytes_per_row']:,.0f} | {r['seconds']:.1f} |")
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
