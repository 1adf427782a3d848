"""Tests of focal_sft, written with ftcore.testing's fixtures (a pytest plugin installed with ftcore).

Run from this folder: ``python -m pytest -q tests``. The unit tests need only ftcore; the plan test
runs ``ftcore run`` and so needs this package installed (``pip install .``), as a user's plan would.
"""

import importlib.metadata

import pytest

from ftcore.testing import chat_rows
from ftcore_example_trainer import FocalSFT
from ftcore_plugins.trainers.base import SFT

OPTIONS = dict(max_steps=6, batch_size=8, max_length=64, learning_rate=3e-3, logging_steps=1, save_steps=1000,
               precision="fp32")


def test_gamma_zero_is_sft_loss_step_by_step(ftcore_stage):
    """focal_gamma = 0 replaces TRL's loss with the same cross-entropy: each step's loss, and so each
    update, equals the built-in sft's from the same weights and data."""
    rows = chat_rows(48)
    sft, focal = ftcore_stage(rows), ftcore_stage(rows)
    reference = SFT(SFT.Options(**OPTIONS)).train(sft)
    metrics = FocalSFT(FocalSFT.Options(focal_gamma=0, **OPTIONS)).train(focal)
    expected, got = sft.reporter.losses("sft"), focal.reporter.losses("sft")
    assert sorted(got) == list(range(1, 7))
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-5), (step, got, expected)
    # The shared run_trl's metrics, tokens counted as TRL counts them.
    assert metrics["global_step"] == 6 and metrics["guard_skipped_steps"] == 0
    assert metrics["train_tokens"] == reference["train_tokens"] > 0


def test_focal_loss_weighs_down_easy_tokens_and_trains(ftcore_stage):
    rows = chat_rows(48)
    plain, focal = ftcore_stage(rows), ftcore_stage(rows)
    SFT(SFT.Options(**OPTIONS)).train(plain)
    FocalSFT(FocalSFT.Options(focal_gamma=2, **{**OPTIONS, "max_steps": 30})).train(focal)
    ce, fl = plain.reporter.losses("sft"), focal.reporter.losses("sft")
    assert 0 < fl[1] < ce[1]  # the same weights at step 1: (1 - p)^2 < 1 on every token
    assert sum(fl[s] for s in range(26, 31)) < 0.5 * sum(fl[s] for s in range(1, 6)), fl


def test_the_option_is_validated():
    with pytest.raises(Exception, match="focal_gamma"):
        FocalSFT.Options(focal_gamma=-1)
    assert FocalSFT.Options().focal_gamma == 2.0 and FocalSFT.Options().save_steps == 50  # sft's options too


def _installed() -> bool:
    try:
        importlib.metadata.distribution("ftcore-example-trainer")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not _installed(), reason="ftcore run finds focal_sft only once this package is installed")
def test_a_plan_trains_with_checkpoints_and_the_guard(ftcore_plan, ftcore_run):
    plan = ftcore_plan({"stage": [{"name": "sft", "trainer": "focal_sft", "data": "chat", "adapter": "full",
                                   "max_steps": 8, "batch_size": 4, "max_length": 64, "logging_steps": 1,
                                   "save_steps": 4, "focal_gamma": 1.0, "guard_max_grad_norm": 1e-6}]})
    result = ftcore_run("run", plan).check()
    assert result.manifest["status"] == "complete"
    metrics = result.stage_metrics("sft")
    assert metrics["global_step"] == 8
    assert sorted(result.losses("sft")) == list(range(1, 9))
    # The guard watched every step: with a threshold no gradient norm stays under, each one is recorded.
    assert metrics["guard_high_grad_norms"] == 8
    assert len(result.losses("sft", "guard/grad_norm_high")) == 8
    assert (result.run_dir / "stages" / "sft" / "checkpoints" / "checkpoint-8" / "COMPLETE.json").exists()
