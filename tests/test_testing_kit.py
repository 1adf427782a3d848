"""ftcore.testing: light to import, registered as a pytest plugin, and its plan builder, runner,
tiny model and stage contexts do what a plugin's tests rely on."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib

import pytest

from ftcore.testing import TINY_PLAN, RecordingReporter, to_toml, write_plan


def test_importing_it_loads_no_torch_and_pytest_finds_its_fixtures(tmp_path):
    code = "import sys, ftcore.testing; print(sorted(m for m in ('torch', 'transformers', 'datasets') if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=3600)  # only catches a hang
    assert r.stdout.strip() == "[]", r.stderr
    # A bare project with no conftest: the fixtures come from the pytest11 entry point alone.
    (tmp_path / "test_bare.py").write_text(
        "def test_plan(ftcore_plan):\n    assert ftcore_plan().name == 'plan.toml'\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=3600)
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout + r.stderr


def test_plan_builder_merges_overrides_and_writes_its_data(ftcore_plan):
    plan = ftcore_plan({"run": {"name": "mine"}, "model": {"num_layers": 1, "vocab_size": None},
                        "stage": [{"name": "a", "trainer": "sft", "data": "chat", "adapter": {"use": "lora", "r": 4}}],
                        "reward": {"cat": {"use": "contains", "words": ["cat"]}}},
                       toml='[[evaluate]]\nuse = "perplexity"\ndata = "chat_eval"\n')
    raw = tomllib.loads(plan.read_text())
    assert raw["run"] == {"name": "mine", "seed": 7}
    assert raw["model"]["num_layers"] == 1 and raw["model"]["hidden_size"] == 64 and "vocab_size" not in raw["model"]
    assert raw["stage"] == [{"name": "a", "trainer": "sft", "data": "chat", "adapter": {"use": "lora", "r": 4}}]
    assert raw["reward"]["cat"]["words"] == ["cat"] and raw["evaluate"][0]["use"] == "perplexity"
    rows = [json.loads(line) for line in (plan.parent / "chat.jsonl").read_text().splitlines()]
    assert len(rows) == 64 and rows[0]["messages"][1]["content"].startswith("the ")
    assert TINY_PLAN["run"]["name"] == "tiny"  # the defaults are not changed by a merge


def test_to_toml_round_trips_and_refuses_what_toml_cannot_hold():
    plan = {"requires": ["x>=1"], "data": {"a b": {"path": 'q"uote\\d'}}, "stage": [{"x": 1.5, "y": True}]}
    assert tomllib.loads(to_toml(plan)) == plan
    with pytest.raises(TypeError, match="cannot write NoneType"):
        to_toml({"run": {"name": None}})


def test_runner_reports_a_bad_plan_as_the_cli_does(ftcore_plan, ftcore_run):
    plan = ftcore_plan({"stage": [{"name": "sft", "trainer": "sft", "data": "nope"}]})
    for in_process in (False, True):
        r = ftcore_run("validate", plan, in_process=in_process)
        assert r.exit_code == 2, r.stderr
        assert "stage[0].data" in r.stderr and "nope" in r.stderr
        assert r.run_dir is None and r.metrics == [] and r.summary is None


@pytest.mark.slow
def test_runner_runs_a_tiny_plan_and_reads_the_run_back(ftcore_plan, ftcore_run):
    result = ftcore_run("run", ftcore_plan(), in_process=True).check()
    assert result.run_dir == ftcore_plan.dir / "runs" / "tiny"
    assert result.manifest["status"] == "complete"
    losses = result.losses("sft")
    assert sorted(losses) == list(range(1, 9))
    assert losses[8] < losses[1]
    assert result.stage_metrics("sft")["global_step"] == 8
    assert result.summary is not None and "sft" in json.dumps(result.summary)
    assert (result.run_dir / "stages" / "sft" / "checkpoints" / "checkpoint-8" / "COMPLETE.json").exists()
    again = ftcore_run("run", ftcore_plan.dir / "plan.toml")  # a subprocess: the run folder is protected
    assert again.exit_code == 2 and "--resume" in again.stderr


def test_tiny_model_is_fresh_each_time_and_generates(ftcore_tiny_model, _ftcore_tiny_model_built):
    import torch

    tiny = ftcore_tiny_model
    assert tiny.model.config.num_hidden_layers == 2 and tiny.model.config.hidden_size == 64
    assert tiny.model is not _ftcore_tiny_model_built.model
    with torch.no_grad():
        next(tiny.model.parameters()).add_(1.0)  # changing this copy leaves the next one as built
    first = next(_ftcore_tiny_model_built.model.parameters())
    assert not torch.equal(first, next(tiny.model.parameters()))
    prompt = tiny.template.render([{"role": "user", "content": "Which is an animal? red cat tree"}],
                                  tiny.tokenizer, add_generation_prompt=True)
    ids = tiny.tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    out = tiny.model.generate(**ids, max_new_tokens=3, do_sample=False)
    assert out.shape[1] == ids["input_ids"].shape[1] + 3


@pytest.mark.slow
def test_stage_context_trains_the_builtin_sft_and_records_its_metrics(ftcore_stage):
    from ftcore_plugins.trainers.base import SFT

    ctx = ftcore_stage()
    assert isinstance(ctx.reporter, RecordingReporter)
    metrics = SFT(SFT.Options(max_steps=12, batch_size=8, max_length=64, learning_rate=3e-3,
                              logging_steps=1)).train(ctx)
    losses = ctx.reporter.losses("sft")
    assert sorted(losses) == list(range(1, 13)) and losses[12] < 0.7 * losses[1], losses
    assert metrics["global_step"] == 12 and metrics["train_tokens"] > 0
    assert ctx.checkpoint_dir.parent == ctx.output_dir and ctx.resume_from is None
