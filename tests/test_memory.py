"""Memory is measured, not estimated: RSS follows a real allocation, peaks reset per
step, and a run records memory at each point of the run."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import run_cli

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_rss_follows_an_allocation_and_the_peak_resets():
    from ftcore.memory import reset_peak, snapshot

    before = snapshot()
    block = bytearray(256 * 2**20)
    block[::4096] = b"\x01" * len(block[::4096])  # touch every page so it is resident
    during = snapshot()
    assert during["rss_mib"] - before["rss_mib"] == pytest.approx(256, rel=0.05)
    del block
    after_free = snapshot()
    assert after_free["peak_rss_mib"] >= during["rss_mib"] - 1  # the high-water mark remembers (to a page run)
    reset_peak()
    reset = snapshot()
    assert reset["peak_rss_mib"] < during["rss_mib"] - 200


def test_release_hands_freed_heap_pages_back():
    """Tensors below glibc's mmap threshold live on the heap; once freed they stay resident (a later
    allocation pins the heap's top) until ``release()`` trims it: what the runner does after each
    stage, evaluation and released export model."""
    import gc

    import torch

    from ftcore.memory import release, snapshot

    small = [torch.ones(25_000) for _ in range(3_000)]  # 100 KB each, 286 MiB in all
    pin = torch.ones(25_000)  # allocated after them: the heap cannot shrink from its top
    del small
    gc.collect()
    freed = snapshot()["rss_mib"]
    release()
    trimmed = snapshot()["rss_mib"]
    assert freed - trimmed > 200, (freed, trimmed)
    assert pin.sum().item() == 25_000



def test_a_pass_over_a_memory_mapped_dataset_is_handed_back_as_it_goes(tmp_path):
    """A datasets Dataset reads its Arrow file through a memory map: a pass over it leaves every page it
    read in the resident set (RSS grows with the corpus). A pass that checks ``MappedPages`` between
    batches hands them back as it goes, so its peak stays near the limit whatever the file's size;
    the rows still read the same afterwards (the kernel reads the pages from the file again)."""
    import datasets

    from ftcore_plugins.common.memory import MiB, MappedPages, reset_peak, snapshot
    from ftcore_plugins.common.prepare import ARROW_PAGES, data_fingerprint

    rows = datasets.Dataset.from_dict({"text": [f"row {i} " + "x" * 2000 for i in range(160_000)]})
    rows.save_to_disk(tmp_path / "ds")
    rows = datasets.load_from_disk(tmp_path / "ds")  # memory-mapped, as a source's rows are
    size_mib = sum(p.stat().st_size for p in (tmp_path / "ds").glob("*.arrow")) / 2**20
    assert size_mib > 300
    pages = MappedPages(lambda path: path.endswith(".arrow"), limit=16 * MiB)

    def total(check=None) -> int:
        n = 0
        for batch in rows.iter(batch_size=1_000):
            n += sum(len(t) for t in batch["text"])
            if check:
                check()
        return n

    before = snapshot()["rss_mib"]
    expected = total()
    assert snapshot()["rss_mib"] - before > 0.8 * size_mib  # unchecked, the pages it read stay resident
    pages.release()
    assert snapshot()["rss_mib"] - before < 0.1 * size_mib
    reset_peak()
    assert total(pages.check) == expected
    peak = snapshot()["peak_rss_mib"] - before
    assert peak < 16 + 8, (peak, size_mib)  # the limit and one 2 MB batch
    reset_peak()
    data_fingerprint(rows)  # checks ARROW_PAGES (64 MiB) between its 10,000-row batches (20 MB)
    assert snapshot()["peak_rss_mib"] - before < 0.5 * size_mib  # 64 MiB, a batch, and the hash's buffers
    ARROW_PAGES.release()
    assert snapshot()["rss_mib"] - before < 0.1 * size_mib


@pytest.mark.parametrize("announced", [0, 1_000, 10_000])
def test_exact_repeats_match_a_set_across_batches(announced):
    """Exact dedup's digests in numpy, sorted at the end, against a Python set fed in order;
    with the rows announced up front, too few of them (the array grows), or none."""
    import random

    from ftcore_plugins.data._quality import ExactDuplicates

    rng = random.Random(3)
    texts = [f"text {rng.randrange(3_000)}" for _ in range(10_000)]
    exact = ExactDuplicates(announced)
    for first in range(0, len(texts), 777):  # batches of uneven size
        exact.add(texts[first:first + 777])
    seen: set[str] = set()
    expected = []
    for t in texts:
        expected.append(t in seen)
        seen.add(t)
    got = exact.repeats()
    assert got.tolist() == expected
    assert 0 < got.sum() < len(texts) and not got[0]
    assert ExactDuplicates().repeats().tolist() == []


def test_rows_kept_by_the_filters_are_an_indices_file_not_a_list_in_memory(tmp_path):
    """The rows left after filters and dedup: the masked rows in order, their indices written to a
    cache file beside the data (memory-mapped), not held as a list."""
    import datasets
    import numpy as np
    from datasets.table import MemoryMappedTable

    from ftcore_plugins.data._quality import rows_where

    datasets.Dataset.from_dict({"n": list(range(50_000))}).save_to_disk(tmp_path / "rows")
    data = datasets.load_from_disk(tmp_path / "rows")
    mask = np.random.default_rng(0).random(len(data)) < 0.7
    kept = rows_where(data, mask)
    assert kept["n"] == np.flatnonzero(mask).tolist()
    assert isinstance(kept._indices, MemoryMappedTable)
    again = rows_where(data, mask)  # the same rows: datasets' cache
    assert again._fingerprint == kept._fingerprint
    other = mask.copy()
    other[0] = not other[0]
    assert rows_where(data, other)._fingerprint != kept._fingerprint


def test_a_run_records_memory_at_each_point(tiny_project):
    plan = tiny_project("""
[[stage]]
name = "sft"
trainer = "sft"
data = "chat"
adapter = { use = "lora", r = 4 }
max_steps = 3

[[export]]
use = "merged"
""")
    result = run_cli("run", str(plan))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Memory (MiB, measured)" in result.stdout
    run = tiny_project.dir / "runs" / "tiny"
    memory = json.loads((run / "summary.json").read_text())["memory"]
    assert list(memory) == ["baseline", "model loaded", "sft: adapter applied", "sft: trained", "export:merged", "exported"]
    export = memory["export:merged"]  # each export is measured, with the resident set it started from
    assert export["peak_rss_mib"] >= export["rss_before_mib"] > 0
    assert memory["model loaded"]["rss_mib"] > memory["baseline"]["rss_mib"]  # torch and a model are resident
    assert memory["sft: trained"]["peak_rss_mib"] >= memory["sft: trained"]["rss_mib"]
    stage = json.loads((run / "stages" / "sft" / "COMPLETE.json").read_text())["metrics"]
    assert stage["memory/peak_rss_mib"] == memory["sft: trained"]["peak_rss_mib"]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(r["stage"] == "memory" and "sft: trained/peak_rss_mib" in r for r in records)


def test_an_export_that_releases_the_model_frees_it(tiny_project):
    """After the last export releases the model (``release_model()``), nothing in the run holds it:
    the base model, trained and merged in place, must not outlive it in a runner's local name (the
    before-evaluation's once did, through every export)."""
    import gc
    import weakref

    import ftcore
    from ftcore.component import Component
    from ftcore.plan import load_plan
    from ftcore.plugins import get_plugin_manager
    from ftcore.runner import Runner

    alive = {}

    class Releasing(Component):
        """Drops the model as the gguf and merged exporters do when they are last."""

        name = "releasing"
        merges = True

        def export(self, ctx):
            refs = [weakref.ref(ctx.model), weakref.ref(ctx.model.get_base_model())]
            assert ctx.consume and ctx.last and ctx.release_model is not None
            ctx.model = None
            ctx.release_model()
            gc.collect()
            alive["after release"] = [type(r()).__name__ for r in refs if r() is not None]
            ctx.path.mkdir(parents=True)
            return ctx.path

    class Plugin:
        @ftcore.hookimpl
        def register_exporters(self, register):
            register(Releasing)

    pm = get_plugin_manager(entry_points=False)
    pm.register(Plugin(), name="releasing-test")
    path = tiny_project("""
[[stage]]
trainer = "sft"
data = "chat"
adapter = { use = "lora", r = 4 }
max_steps = 2
batch_size = 4

[[evaluate]]
use = "perplexity"
data = "chat_eval"

[[export]]
use = "releasing"
""")
    Runner(load_plan(path, pm.registry()), pm, None).run()
    assert alive == {"after release": []}
