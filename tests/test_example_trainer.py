"""The example trainer package (examples/ftcore-example-trainer, ``focal_sft``), pip-installed for
real: built on the public ``SFT`` base, it keeps checkpoints, exact resume after SIGKILL and the
stability guard; and its own tests, written with ftcore.testing, pass where it is installed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from conftest import ROOT, installed, run_kit, start_cli
from ftcore.testing import complete_checkpoints, wait_until, write_plan

EXAMPLE = ROOT / "examples" / "ftcore-example-trainer"
DIST = "ftcore-example-trainer"
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # the same numerics in every process; kinder to a shared CPU

# 64 rows / 6 = 11 steps per epoch, 2 epochs: checkpoints every 4 steps, some mid-epoch. A gradient-norm
# threshold no step stays under makes the guard record every step it watches.
STAGE = {"name": "sft", "trainer": "focal_sft", "data": "chat", "adapter": "full", "focal_gamma": 2.0,
         "epochs": 2, "batch_size": 6, "max_length": 64, "learning_rate": 3e-3, "precision": "fp32",
         "logging_steps": 1, "save_steps": 4, "save_total_limit": 1, "guard_max_grad_norm": 1e-6}


@pytest.fixture(scope="module")
def example_installed(tmp_path_factory):
    with installed(EXAMPLE, DIST, tmp_path_factory.mktemp("example-trainer")):
        yield


@pytest.mark.slow
def test_killed_focal_sft_run_resumes_with_the_same_losses(example_installed, tmp_path):
    reference = write_plan(tmp_path, {"run": {"name": "reference"}, "stage": [STAGE]}, name="reference.toml")
    done = run_kit("run", reference, env=ONE_THREAD).check()
    expected = done.losses("sft")
    assert sorted(expected) == list(range(1, 23))

    plan = write_plan(tmp_path, {"stage": [STAGE]})
    run_dir = tmp_path / "runs" / "tiny"
    proc = start_cli("run", str(plan), env=ONE_THREAD)
    try:
        wait_until(proc, lambda: complete_checkpoints(run_dir, "sft"))
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.communicate()
    resumed = run_kit("run", plan, "--resume", env=ONE_THREAD)
    assert resumed.exit_code == 0, resumed.stderr
    first_kept = int(resumed.stdout.split("resuming from checkpoint-")[1].split()[0].rstrip(".,;:"))
    assert 4 <= first_kept < 22

    assert resumed.manifest["status"] == "complete"
    metrics = resumed.stage_metrics("sft")
    assert metrics["global_step"] == 22
    records = [r for r in resumed.metrics if r["stage"] == "sft" and "loss" in r]
    assert {r["step"] for r in records} == set(expected)
    # Every record, from the killed and the resumed process: the uninterrupted run's loss at that step.
    worst = max(abs(r["loss"] - expected[r["step"]]) for r in records)
    assert worst <= 1e-6, worst
    assert resumed.losses("sft") == pytest.approx(expected, abs=1e-6)
    # The stability guard watched the subclass's steps in both processes: one record per step.
    assert set(resumed.losses("sft", "guard/grad_norm_high")) == set(range(1, 23))
    assert metrics["guard_high_grad_norms"] == 22  # every step of the stage, across the kill and the resume
    print(f"resumed from checkpoint-{first_kept}; largest loss difference to the uninterrupted run: {worst:.2e}")


@pytest.mark.slow
def test_the_example_packages_own_tests_pass(example_installed, tmp_path):
    """Its tests use ftcore.testing's fixtures only through the pytest11 plugin ftcore installs."""
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(EXAMPLE / "tests")],
                       cwd=EXAMPLE, capture_output=True, text=True, timeout=3600,
                       env={**os.environ, **ONE_THREAD, "PYTHONDONTWRITEBYTECODE": "1"})
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "4 passed" in r.stdout, r.stdout[-2000:]  # the plan test too: the package is installed
