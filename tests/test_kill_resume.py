"""SIGKILL trials (benchmarks/kill_resume.py): a run killed while loading, while a checkpoint is written
and while the export is written, each resumed, ends with the uninterrupted run's step losses, weights
and summary totals, one loss point per step in the report, and never a partial export under its name.
Killing mid-training is also ``test_training.py``'s resume test; the benchmark runs 20 trials."""

from __future__ import annotations

import importlib.util
import json

import pytest

from conftest import ROOT, run_cli, run_script


@pytest.mark.slow
def test_killed_while_loading_checkpointing_and_exporting_then_resumed_is_the_same_run(tmp_path):
    done = run_script(ROOT / "benchmarks" / "kill_resume.py", "--trials", "3", "--kinds", "loading", "checkpoint",
                      "export", "--keep", str(tmp_path / "trials"), "--json", str(tmp_path / "r.json"), timeout=3600)
    assert done.returncode in (0, 1), done.stderr[-3000:]
    results = json.loads((tmp_path / "r.json").read_text())
    assert [r["kind"] for r in results] == ["loading", "checkpoint", "export"]
    assert all(r["killed"] for r in results), results  # each kill landed before the run ended
    assert [r["problems"] for r in results] == [[], [], []]


# -- a LoRA stage after a full stage, on a template that adds tokens (issue #30) ----------------------
def _tokens_project(folder):
    """Two stages on the tiny scratch model whose tokenizer lacks llama3's four markers, so the template
    adds them (the embedding grows by four rows): full fine-tuning, then LoRA, whose checkpoints come
    every 4 steps; a merged and an adapter export."""
    from ftcore.testing import write_plan

    common = {"trainer": "sft", "data": "chat", "batch_size": 4, "max_length": 64, "learning_rate": 3e-3,
              "logging_steps": 1, "precision": "fp32"}
    stages = [{"name": "full", "adapter": "full", "max_steps": 3, "save_steps": 100, **common},
              {"name": "lora", "adapter": {"use": "lora", "r": 8}, "max_steps": 8, "save_steps": 4, **common}]
    return write_plan(folder, {"template": {"use": "llama3"}, "stage": stages},
                      '[[export]]\nuse = "merged"\n\n[[export]]\nuse = "adapter"\n')


def _step_losses(run):
    from ftcore_plugins.commands.report import read_records

    out = {}
    for r in read_records(run):
        if "loss" in r and r.get("step") is not None:
            assert (r["stage"], r["step"]) not in out, f"two points for {(r['stage'], r['step'])}"
            out[(r["stage"], r["step"])] = r["loss"]
    return out


def _tensors(run):
    """Every tensor the run leaves as its result: the merged model, the adapter (with peft's trainable
    token rows) and each stage's output, by file and name."""
    from safetensors.torch import load_file

    files = [run / "exports" / "merged" / "model.safetensors", run / "exports" / "adapter" / "adapter_model.safetensors",
             run / "stages" / "full" / "output" / "model.safetensors",
             run / "stages" / "lora" / "output" / "adapter_model.safetensors"]
    return {f"{f.relative_to(run).as_posix()}:{k}": v for f in files for k, v in load_file(f).items()}


def _bench():
    spec = importlib.util.spec_from_file_location("kill_resume", ROOT / "benchmarks" / "kill_resume.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


@pytest.fixture(scope="module")
def tokens_reference(tmp_path_factory):
    """The uninterrupted run of :func:`_tokens_project`, once for both kills."""
    folder = tmp_path_factory.mktemp("tokens-reference")
    ref = run_cli("run", str(_tokens_project(folder)), env=_bench().QUIET)
    assert ref.returncode == 0, ref.stderr[-3000:]
    return folder / "runs" / "tiny"


@pytest.mark.slow
@pytest.mark.parametrize("when", ["after a checkpoint", "before a checkpoint"])
def test_a_lora_stage_after_a_full_one_on_added_tokens_killed_and_resumed_is_the_same_run(tmp_path, when,
                                                                                         tokens_reference):
    """SIGKILL during the LoRA stage, once after its first checkpoint is complete and once before it has
    any, then ``--resume``: every step's loss and every saved weight (the merged model with its four
    grown embedding rows, the adapter with peft's trainable rows of the added tokens, each stage's
    output) are bit for bit the uninterrupted run's. Bitwise, not within a tolerance: both runs do the
    same fp32 operations in one thread on the same CPU, from a checkpoint that holds the weights, the
    optimizer and the RNG states exactly, so any difference is a resume that lost or redid something."""
    import signal
    import time

    import torch

    bench = _bench()
    reference = tokens_reference
    run = tmp_path / "killed" / "runs" / "tiny"
    checkpoints = run / "stages" / "lora" / "checkpoints"

    def lora_steps():
        return sum(1 for k in _step_losses(run) if k[0] == "lora") if (run / "metrics.jsonl").exists() else 0

    def complete():
        return [c.name for c in checkpoints.glob("checkpoint-*") if (c / "COMPLETE.json").exists()]

    ready = (lambda: bool(complete())) if when == "after a checkpoint" else (lambda: lora_steps() >= 2)
    plan = _tokens_project(tmp_path / "killed")
    proc = bench.start(plan)
    deadline = time.monotonic() + 600
    while proc.poll() is None and not ready() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert proc.poll() is None, "the run ended before the moment to kill it: " + proc.communicate()[1][-2000:]
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert (run / "stages" / "full" / "COMPLETE.json").exists() and not (run / "stages" / "lora" / "COMPLETE.json").exists()
    if when == "after a checkpoint":
        assert complete() and not (run / "exports" / "merged").exists()
    else:
        assert not list(checkpoints.glob("checkpoint-*")), "a checkpoint was already there"

    resumed = run_cli("run", str(plan), "--resume", env=bench.QUIET)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (", resuming from checkpoint-4" in resumed.stdout) == (when == "after a checkpoint"), resumed.stdout

    got, want = _step_losses(run), _step_losses(reference)
    assert sorted(want) == [("full", s) for s in (1, 2, 3)] + [("lora", s) for s in range(1, 9)]
    assert got == want  # every step's loss, exactly
    a, b = _tensors(run), _tensors(reference)
    assert sorted(a) == sorted(b)
    assert any("trainable_tokens" in k for k in b), sorted(b)  # the added tokens' rows, in the adapter
    differ = {k: float((a[k] - b[k]).abs().max()) for k in b if not torch.equal(a[k], b[k])}
    assert not differ, differ
    merged = b["exports/merged/model.safetensors:model.embed_tokens.weight"]
    full = b["stages/full/output/model.safetensors:model.embed_tokens.weight"]
    vocabulary = merged.shape[0]
    assert vocabulary == full.shape[0]
    # The four added rows (the last four) were trained by the LoRA stage: the merge changed them.
    assert not torch.equal(merged[vocabulary - 4:], full[vocabulary - 4:])
