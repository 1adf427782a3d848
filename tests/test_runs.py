"""End-to-end runs through the CLI: stages chain, exports load in plain libraries,
resume after SIGKILL, and run directories are never clobbered."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from conftest import ROOT, run_cli
from ftcore.testing import complete_checkpoints, start_ftcore, wait_until

pytestmark = pytest.mark.slow

TWO_STAGES = """
[[stage]]
name = "pretrain"
trainer = "pretrain"
data = "text"
adapter = "full"
max_steps = 6
batch_size = 8
max_length = 64
logging_steps = 2
save_steps = 3

[[stage]]
name = "sft"
trainer = "sft"
data = "chat"
adapter = {{ use = "lora", r = 4, lora_alpha = 8 }}
max_steps = {sft_steps}
batch_size = 4
max_length = 64
learning_rate = 3e-3
logging_steps = 1
save_steps = {save_steps}

[[evaluate]]
use = "perplexity"
data = "chat_eval"

[[export]]
use = "merged"

[[export]]
use = "adapter"
"""


def test_two_stage_run_exports_load_in_plain_transformers_and_peft(tiny_project):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    plan = tiny_project(TWO_STAGES.format(sft_steps=8, save_steps=4))
    result = run_cli("run", str(plan))
    assert result.returncode == 0, result.stderr
    run = tiny_project.dir / "runs" / "tiny"

    summary = json.loads((run / "summary.json").read_text())
    before = summary["evaluations"]["before"]["perplexity"]["perplexity"]
    after = summary["evaluations"]["after"]["perplexity"]["perplexity"]
    assert after < before  # training helped on held-out data
    assert json.loads((run / "stages" / "sft" / "COMPLETE.json").read_text())["adapter_from"] == 1

    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    assert manifest["resolved"]["stages"][1]["trainer"] == "ftcore:sft"
    assert {Path(p).name for p in manifest["data_files"]} == {"text.jsonl", "chat.jsonl", "chat_eval.jsonl"}
    assert "torch" in manifest["packages"] and manifest["hardware"]["cpu_count"]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(r["stage"] == "sft" and "loss" in r for r in records)

    # The merged export is a plain transformers model folder that generates.
    merged_dir = run / "exports" / "merged"
    assert (merged_dir / "model.safetensors").exists()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    tok = AutoTokenizer.from_pretrained(merged_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Which is an animal? red fox tree"}],
                                     tokenize=False, add_generation_prompt=True)
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)
    out = merged.generate(**ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] > ids["input_ids"].shape[1]

    # The adapter export loads with plain peft on top of the stage it was trained from,
    # and gives the same logits as the merged model.
    base = AutoModelForCausalLM.from_pretrained(run / "stages" / "pretrain" / "output")
    peft_model = PeftModel.from_pretrained(base, run / "exports" / "adapter")
    with torch.no_grad():
        a = peft_model(**ids).logits
        b = merged(**ids).logits
    assert torch.allclose(a, b, atol=1e-4)


def test_sigkill_mid_training_then_resume_completes(tiny_project):
    plan = tiny_project(TWO_STAGES.format(sft_steps=400, save_steps=5))
    run = tiny_project.dir / "runs" / "tiny"
    proc = start_ftcore("run", plan)
    try:  # kill once a checkpoint is complete: one killed mid-save is (rightly) never resumed from
        wait_until(proc, lambda: complete_checkpoints(run, "sft"), timeout=600)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.communicate()
    assert (run / "stages" / "pretrain" / "COMPLETE.json").exists()
    assert not (run / "stages" / "sft" / "COMPLETE.json").exists()

    again = run_cli("run", str(plan))  # without --resume: refuses, changes nothing
    assert again.returncode == 2 and "--resume" in again.stderr

    resumed = run_cli("run", str(plan), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "stage pretrain is complete" in resumed.stdout
    assert "resuming from checkpoint-" in resumed.stdout
    done = json.loads((run / "stages" / "sft" / "COMPLETE.json").read_text())
    assert done["metrics"]["global_step"] == 400
    steps = [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
             if r["stage"] == "sft" and "loss" in r]
    assert steps[-1] == 400 and steps.count(1) == 1  # continued from the checkpoint, not from step 1
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "complete" and len(manifest["resumed_at"]) == 1


def test_existing_run_dir_of_another_plan_is_refused_and_force_moves_it_aside(tiny_project):
    plan = tiny_project("""
[[evaluate]]
use = "perplexity"
data = "chat_eval"
when = "before"
""")
    assert run_cli("run", str(plan)).returncode == 0
    run = tiny_project.dir / "runs" / "tiny"
    marker = run / "my-notes.txt"
    marker.write_text("mine")

    changed = tiny_project.dir / "changed.toml"
    changed.write_text(plan.read_text().replace("seed = 7", "seed = 8"))  # same run name, other plan
    refused = run_cli("run", str(changed))
    assert refused.returncode == 2 and "different plan" in refused.stderr
    assert marker.read_text() == "mine"

    forced = run_cli("run", str(changed), "--force")
    assert forced.returncode == 0, forced.stderr
    aside = [p for p in run.parent.iterdir() if p.name.startswith("tiny.") and p.name.endswith(".old")]
    assert len(aside) == 1 and (aside[0] / "my-notes.txt").read_text() == "mine"


def test_a_run_that_failed_before_training_starts_over_without_a_flag(tiny_project):
    """Bad data stops a fresh run after its folder exists; once the data is fixed, the same command runs
    it again in that folder. A run that trained a step is never replaced that way."""
    plan = tiny_project("""
[[stage]]
name = "sft"
trainer = "sft"
data = "chat"
max_steps = 2
""")
    good = (tiny_project.dir / "chat.jsonl").read_text()
    (tiny_project.dir / "chat.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n' + good)
    failed = run_cli("run", str(plan))
    assert failed.returncode == 2 and failed.stderr.startswith("error: data.chat (chat.jsonl), row 1: "), failed.stderr
    run = tiny_project.dir / "runs" / "tiny"
    assert json.loads((run / "manifest.json").read_text())["status"] == "failed"

    (tiny_project.dir / "chat.jsonl").write_text(good)
    again = run_cli("run", str(plan))
    assert again.returncode == 0, again.stderr
    assert "the previous run here failed before training" in again.stdout
    assert json.loads((run / "manifest.json").read_text())["status"] == "complete"

    # Trained, then failed (here: its manifest says so): kept, and the plain command refuses it.
    manifest = json.loads((run / "manifest.json").read_text())
    (run / "manifest.json").write_text(json.dumps({**manifest, "status": "failed"}))
    refused = run_cli("run", str(plan))
    assert refused.returncode == 2 and "--resume" in refused.stderr
    assert (run / "stages" / "sft" / "output").is_dir()


def test_export_never_overwrites_an_existing_user_folder(tiny_project):
    user_dir = tiny_project.dir / "my-model"
    user_dir.mkdir()
    (user_dir / "weights.bin").write_text("precious")
    plan = tiny_project(TWO_STAGES.format(sft_steps=2, save_steps=5).split("[[export]]")[0]
                        + '[[export]]\nuse = "merged"\npath = "my-model"\n')
    result = run_cli("run", str(plan))
    assert result.returncode == 2 and "my-model" in result.stderr and "already exists" in result.stderr
    assert (user_dir / "weights.bin").read_text() == "precious"
    assert not (tiny_project.dir / "runs").exists()


def test_quickstart_plan_validates():
    result = run_cli("validate", str(ROOT / "examples" / "quickstart" / "plan.toml"))
    assert result.returncode == 0, result.stderr


def test_train_tokens_counts_every_real_token_once_per_epoch(tiny_project):
    """The tokens and tokens/s a stage reports count real (non-padding) tokens: checked
    against the plan's rows tokenized independently with the run's own tokenizer."""
    from transformers import AutoTokenizer

    from conftest import chat_rows

    plan = tiny_project("""
[[stage]]
name = "sft"
trainer = "sft"
data = "chat"
adapter = { use = "lora", r = 4 }
epochs = 2
batch_size = 5
max_length = 64
""")
    assert run_cli("run", str(plan)).returncode == 0
    run = tiny_project.dir / "runs" / "tiny"
    tok = AutoTokenizer.from_pretrained(run / "model" / "tokenizer")
    expected = 0
    for row in chat_rows(64):  # what conftest wrote to chat.jsonl
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in row["messages"])
        expected += len(tok(text, add_special_tokens=False)["input_ids"])
    metrics = json.loads((run / "stages" / "sft" / "COMPLETE.json").read_text())["metrics"]
    assert metrics["train_tokens"] == 2 * expected
    assert metrics["tokens_per_second"] == pytest.approx(metrics["train_tokens"] / metrics["train_seconds"])
