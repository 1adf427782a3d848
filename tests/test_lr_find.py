"""``ftcore lr-find``: a range test whose suggestion holds on the quickstart, where the good range is known."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from conftest import ROOT, run_cli

pytestmark = pytest.mark.slow


def test_the_suggestion_trains_better_than_a_decade_above_and_below(tmp_path):
    project = tmp_path / "quickstart"
    shutil.copytree(ROOT / "examples" / "quickstart", project, ignore=shutil.ignore_patterns("runs"))
    plot = tmp_path / "lr.png"
    r = run_cli("lr-find", str(project / "plan.toml"), "--verify", "--json", "--plot", str(plot))
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["stage"] == "pretrain"  # the first stage that trains the model
    assert 1e-7 < result["suggestion"] < 1
    # The documented rule: where the smoothed loss falls fastest against log(rate), before its lowest point.
    rates, smooth = result["rates"], result["smoothed"]
    lowest = min(range(len(smooth)), key=smooth.__getitem__)
    steepest = min(range(1, lowest),
                   key=lambda i: (smooth[i + 1] - smooth[i - 1]) / (math.log(rates[i + 1]) - math.log(rates[i - 1])))
    assert result["suggestion"] == rates[steepest]
    arms = result["verify"]
    print({name: round(arm["final"], 4) for name, arm in arms.items()}, f"suggestion {result['suggestion']:.3g}")
    # Over the same steps from the same weights, a decade above and a decade below both end worse.
    assert arms["1x"]["final"] < arms["0.1x"]["final"]
    assert arms["1x"]["final"] < arms["10x"]["final"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (project / "runs").exists()  # nothing written in a run folder

    again = run_cli("lr-find", str(project / "plan.toml"), "--plot", str(plot))
    assert again.returncode == 2 and "already exists" in again.stderr  # never overwrites a file


def test_an_unknown_stage_is_refused_in_one_line(tmp_path):
    for name in ("quickstart", "rlhf"):  # rlhf reads the quickstart's data
        shutil.copytree(ROOT / "examples" / name, tmp_path / name, ignore=shutil.ignore_patterns("runs"))
    project = tmp_path / "rlhf"
    r = run_cli("lr-find", str(project / "plan.toml"), "--stage", "nope")
    assert r.returncode == 2 and "no stage named 'nope'" in r.stderr and "Traceback" not in r.stderr
