"""SIGKILL trials (benchmarks/kill_resume.py): a run killed while loading, while a checkpoint is written
and while the export is written, each resumed, ends with the uninterrupted run's step losses, weights
and summary totals, one loss point per step in the report, and never a partial export under its name.
Killing mid-training is also ``test_training.py``'s resume test; the benchmark runs 20 trials."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from conftest import ROOT


@pytest.mark.slow
def test_killed_while_loading_checkpointing_and_exporting_then_resumed_is_the_same_run(tmp_path):
    spec = importlib.util.spec_from_file_location("kill_resume", ROOT / "benchmarks" / "kill_resume.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules["kill_resume"] = bench
    spec.loader.exec_module(bench)
    results = bench.main(["--trials", "3", "--kinds", "loading", "checkpoint", "export", "--keep", str(tmp_path)])
    assert [r["kind"] for r in results] == ["loading", "checkpoint", "export"]
    assert all(r["killed"] for r in results), results  # each kill landed before the run ended
    assert [r["problems"] for r in results] == [[], [], []]
