"""The GPU proxy that CI holds (benchmarks/step_ops.py): operators and host syncs of one training step on a
packed batch, ftcore against TRL on the same batch, counted with torch.profiler on the CPU."""

from __future__ import annotations

import json

import pytest

from conftest import ROOT, run_script


@pytest.mark.slow
def test_the_gpu_path_issues_no_more_operators_than_trl_and_its_syncs_stay_flat(tmp_path):
    out = tmp_path / "ops.jsonl"
    r = run_script(ROOT / "benchmarks" / "step_ops.py", "--tiny", "--json", str(out), timeout=900,
                   env={"PYTHONWARNINGS": "ignore"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    by = {(row["arm"], row["layers"], row["words"]): row for row in rows}
    layers, words = sorted({row["layers"] for row in rows}), sorted({row["words"] for row in rows})
    assert len(layers) == 2 and len(words) == 2
    for n in layers:
        few, many = (by[("trl", n, w)]["samples"] for w in reversed(words))
        assert many > 2 * few  # the two batches differ in samples, not in positions
        for w in words:
            trl, block = by[("trl", n, w)], by[("ftcore:sdpa_block", n, w)]
            assert trl["samples"] == block["samples"]  # the same batch
            assert block["operators"] <= 1.2 * trl["operators"]
    # The GPU path's syncs do not grow with the samples or the layers, and are fewer than TRL's.
    block_syncs = {by[("ftcore:sdpa_block", n, w)]["syncs"] for n in layers for w in words}
    assert len(block_syncs) == 1 and block_syncs.pop() <= min(by[("trl", n, w)]["syncs"] for n in layers for w in words)
    # The counter sees a loop over samples: the CPU's per-sample path grows with them (so this can fail).
    for n in layers:
        assert by[("ftcore", n, words[0])]["operators"] > 1.3 * by[("ftcore", n, words[1])]["operators"]
    # What the table prints is what was measured.
    for row in rows:
        assert f"| {row['arm']} | {row['positions']} | {row['operators']:,} |" in r.stdout
