"""Preference trainers (dpo, kto, orpo, reward) on a learnable synthetic task: the chosen answer
names the animal in the prompt, the rejected one names another word of it. Each trainer must
improve its own objective on held-out pairs; DPO's reference must be the stage-start policy."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from conftest import ANIMALS, OTHERS, SHARED, chat_rows, run_cli, write_jsonl


def pair_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        animal, others = rng.choice(ANIMALS), rng.sample(OTHERS, 2)
        words = [animal, *others]
        rng.shuffle(words)
        rows.append({"prompt": [{"role": "user", "content": "Which is an animal? " + " ".join(words)}],
                     "chosen": [{"role": "assistant", "content": f"the {animal}"}],
                     "rejected": [{"role": "assistant", "content": f"the {others[0]}"}]})
    return rows


def stage(tmp_path: Path, adapter: str = "lora", train=None, evaluation=None, perturb: bool = False):
    """A tiny scratch model (ChatML), its adapter applied as the runner applies it, and a StageContext."""
    import datasets
    import torch

    from ftcore.context import AdapterContext, LoadContext, StageContext
    from ftcore.plugins import get_plugin_manager
    from ftcore.reporter import Reporter

    get_plugin_manager()  # makes ftcore_plugins importable from the source tree
    from ftcore_plugins.adapters.full import FullAdapter
    from ftcore_plugins.adapters.lora import LoraAdapter
    from ftcore_plugins.models.scratch import ScratchModelLoader
    from ftcore_plugins.quantizers.none import NoQuantizer
    from ftcore_plugins.templates.chatml import ChatMLTemplate

    quiet = Reporter(None, None, None, None)
    from ftcore.context import RunInfo

    run = RunInfo(plan=type("Plan", (), {"seed": 7})(), run_dir=Path("."))  # a single process, rank 0
    chat = datasets.Dataset.from_list(chat_rows(64))
    loader = ScratchModelLoader(ScratchModelLoader.Options(
        hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_position_embeddings=128,
        tokenizer_data=["chat"], vocab_size=300))
    model, tok = loader.load(LoadContext(run, quiet, NoQuantizer(), seed=0, work_dir=tmp_path / "model",
                                         data={"chat": chat}.__getitem__))
    template = ChatMLTemplate()
    model, tok = template.prepare(model, tok)
    component = LoraAdapter(LoraAdapter.Options(r=8, lora_alpha=16)) if adapter == "lora" else FullAdapter()
    model = component.apply(model, AdapterContext(run, quiet, None))
    if perturb:  # as if an earlier stage had trained this adapter: disabling it no longer gives the policy
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    train = datasets.Dataset.from_list(train if train is not None else pair_rows(128, 0))
    evaluation = datasets.Dataset.from_list(evaluation if evaluation is not None else pair_rows(32, 1))
    return StageContext(run, quiet, "pref", model, tok, template, train, evaluation, tmp_path / "stage",
                        tmp_path / "stage" / "checkpoints", None, 7, adapter=component, continues_adapter=perturb)


def options(cls, **kw):
    base = dict(max_steps=24, batch_size=8, max_length=64, learning_rate=5e-3, save_steps=1000, logging_steps=8)
    return cls.Options(**{**base, **kw})


def logps_of(model, ctx):
    from ftcore_plugins.common.preference import answer_logps, render
    from ftcore_plugins.trainers._preference import length_report

    ids = length_report(ctx, {"eval": render(ctx, ctx.eval_data, strip_bos=True)}, 64, style="trl")["eval"]
    return answer_logps(model, ids, 64, ctx.tokenizer.pad_token_id, 8)


# -- dpo -----------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("adapter,perturb", [("lora", False), ("lora", True), ("full", False)],
                         ids=["fresh-adapter", "continued-adapter", "full-finetune"])
def test_dpo_reference_is_the_stage_start_policy_and_reward_accuracy_rises(tmp_path, adapter, perturb):
    import copy

    import torch

    from ftcore_plugins.trainers.dpo import DPOTrainer

    ctx = stage(tmp_path, adapter, perturb=perturb)
    start = copy.deepcopy(ctx.model)
    metrics = DPOTrainer(options(DPOTrainer)).train(ctx)
    print(adapter, perturb, {k: round(v, 4) for k, v in metrics.items() if k.startswith(("eval_", "ref"))})

    # TRL's reference log-probs of the held-out answers are the stage-start policy's.
    assert metrics["reference_logp_max_diff"] < 1e-3
    # ... and the stage-start policy is not what training produced (the check can fail).
    assert (logps_of(ctx.model, ctx) - logps_of(start, ctx))[..., 0].abs().max() > 1e-2
    # Held-out objective: implicit-reward accuracy and the policy's own chosen-vs-rejected margin.
    assert metrics["eval_pairs"] == 32
    assert metrics["eval_reward_accuracy"] >= 0.9 and metrics["eval_reward_margin"] > 0
    assert metrics["eval_logp_margin"] > metrics["eval_logp_margin_before"] + 0.5
    # TRL's frozen `ref` adapter is gone again: the runner saves only the trained adapter.
    assert set(getattr(ctx.model, "peft_config", {})) <= {"default"}
    assert "forward" not in vars(ctx.model)
    if perturb:  # disabling the continued adapter gives another model than the reference
        with ctx.model.disable_adapter():
            assert (logps_of(ctx.model, ctx) - logps_of(start, ctx))[..., 0].abs().max() > 1e-2
    del torch


def test_dpo_on_chat_rows_is_a_one_line_error(tmp_path):
    from ftcore.errors import FtcoreError
    from ftcore_plugins.trainers.dpo import DPOTrainer

    ctx = stage(tmp_path, "lora")
    import datasets

    ctx.train_data = datasets.Dataset.from_list(chat_rows(8))
    with pytest.raises(FtcoreError) as err:
        DPOTrainer(options(DPOTrainer)).train(ctx)
    message = str(err.value)
    assert "\n" not in message and "stage pref" in message and "preference pairs" in message
    assert "messages" in message and 'trainer = "sft"' in message


# -- kto, orpo, reward ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_kto_on_pairs_improves_held_out_reward_margin(tmp_path):
    from ftcore_plugins.trainers.kto import KTOTrainer

    ctx = stage(tmp_path, "lora")
    metrics = KTOTrainer(options(KTOTrainer)).train(ctx)
    print({k: round(v, 4) for k, v in metrics.items() if k.startswith("eval_")})
    assert metrics["eval_reward_accuracy"] >= 0.9 and metrics["eval_reward_margin"] > 0
    assert metrics["eval_logp_margin"] > metrics["eval_logp_margin_before"] + 0.5
    assert set(ctx.model.peft_config) == {"default"}


@pytest.mark.slow
def test_orpo_improves_held_out_reward_accuracy(tmp_path):
    from ftcore_plugins.trainers.orpo import ORPOTrainer

    ctx = stage(tmp_path, "lora")
    metrics = ORPOTrainer(options(ORPOTrainer)).train(ctx)
    print({k: round(v, 4) for k, v in metrics.items() if k.startswith("eval_")})
    assert metrics["eval_reward_accuracy"] >= 0.9
    assert metrics["eval_reward_accuracy"] > metrics["eval_reward_accuracy_before"]
    assert metrics["eval_reward_margin"] > metrics["eval_reward_margin_before"]


@pytest.mark.slow
def test_reward_model_learns_pairs_is_saved_merged_and_leaves_the_policy_alone(tmp_path):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from ftcore_plugins.trainers.reward import RewardTrainer

    ctx = stage(tmp_path, "lora")
    policy = ctx.model
    weights = {k: v.clone() for k, v in policy.state_dict().items()}
    metrics = RewardTrainer(options(RewardTrainer, learning_rate=3e-3)).train(ctx)
    print({k: round(v, 4) for k, v in metrics.items() if k.startswith("eval_")})
    assert metrics["eval_accuracy"] >= 0.9 and metrics["eval_accuracy"] > metrics["eval_accuracy_before"]
    assert metrics["eval_margin"] > metrics["eval_margin_before"]

    assert ctx.model is policy and set(policy.peft_config) == {"default"}
    assert all(torch.equal(v, weights[k]) for k, v in policy.state_dict().items())

    loaded, info = AutoModelForSequenceClassification.from_pretrained(ctx.output, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert (ctx.output / "model.safetensors").exists() and not (ctx.output / "adapter_config.json").exists()
    tok = AutoTokenizer.from_pretrained(ctx.output)
    assert loaded.config.num_labels == 1 and loaded.config.pad_token_id == tok.pad_token_id is not None
    # The saved model scores a held-out pair the way training left it.
    row = pair_rows(1, 5)[0]
    texts = [ctx.template.render(row["prompt"] + row[k], tok) for k in ("chosen", "rejected")]
    batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        chosen, rejected = loaded(**batch).logits[:, 0]
    assert chosen > rejected


# -- the plan: validate and run through the CLI -----------------------------------------------------


PAIRS_DATA = """
[data.pairs]
use = "jsonl"
path = "pairs.jsonl"

[data.pairs_eval]
use = "jsonl"
path = "pairs_eval.jsonl"
"""


def test_validate_reports_wrong_data_kinds_and_bad_options(tiny_project):
    write_jsonl(tiny_project.dir / "pairs.jsonl", pair_rows(4, 0))
    write_jsonl(tiny_project.dir / "pairs_eval.jsonl", pair_rows(4, 1))
    plan = tiny_project(PAIRS_DATA + """
[[stage]]
name = "dpo"
trainer = "dpo"
data = "chat"
loss_type = "sigmoidd"

[[stage]]
name = "exo"
trainer = "dpo"
data = "pairs"
loss_type = "exo_pair"

[[stage]]
name = "rm"
trainer = "reward"
data = "text"
""")
    result = run_cli("validate", str(plan))
    assert result.returncode == 2
    assert "stage[0].loss_type" in result.stderr and "unknown DPO loss 'sigmoidd'" in result.stderr
    assert "label_smoothing > 0" in result.stderr
    fixed = plan.read_text().replace('"sigmoidd"', '"ipo"').replace('loss_type = "exo_pair"',
                                                                   'loss_type = "exo_pair"\nlabel_smoothing = 0.001')
    plan.write_text(fixed)
    result = run_cli("validate", str(plan))
    assert result.returncode == 2
    assert "stage[0].data: trainer 'dpo' needs preference pairs" in result.stderr
    assert "[data.chat] holds chat rows" in result.stderr and 'trainer = "sft"' in result.stderr
    assert "stage[2].data: trainer 'reward' needs preference pairs" in result.stderr
    assert "stage[1]" not in result.stderr
    plan.write_text(fixed.replace('data = "chat"', 'data = "pairs"').replace('data = "text"', 'data = "pairs"'))
    result = run_cli("validate", str(plan))
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("trainer", ["dpo", "kto", "orpo"])
def test_padding_free_refuses_prompt_learning_adapters(tiny_project, trainer):
    """Virtual tokens come once per row: with padding_free they would come once per batch."""
    write_jsonl(tiny_project.dir / "pairs.jsonl", pair_rows(4, 0))
    write_jsonl(tiny_project.dir / "pairs_eval.jsonl", pair_rows(4, 1))
    stage = f"""
[[stage]]
name = "pref"
trainer = "{trainer}"
data = "pairs"
padding_free = true
adapter = {{ use = "prompt_tuning", num_virtual_tokens = 4 }}
"""
    plan = tiny_project(PAIRS_DATA + stage)
    result = run_cli("validate", str(plan))
    assert result.returncode == 2
    assert "padding_free: stage 'pref' uses prompt_tuning" in result.stderr and "set padding_free = false" in result.stderr
    plan.write_text(plan.read_text().replace('adapter = { use = "prompt_tuning", num_virtual_tokens = 4 }', 'adapter = "lora"'))
    assert run_cli("validate", str(plan)).returncode == 0


@pytest.mark.slow
def test_dpo_then_reward_stage_through_the_runner(tiny_project):
    write_jsonl(tiny_project.dir / "pairs.jsonl", pair_rows(64, 0))
    write_jsonl(tiny_project.dir / "pairs_eval.jsonl", pair_rows(16, 1))
    plan = tiny_project(PAIRS_DATA + """
[[stage]]
name = "dpo"
trainer = "dpo"
data = "pairs"
eval_data = "pairs_eval"
adapter = { use = "lora", r = 4 }
max_steps = 6
batch_size = 8
max_length = 64
learning_rate = 5e-3

[[stage]]
name = "rm"
trainer = "reward"
data = "pairs"
eval_data = "pairs_eval"
adapter = { use = "lora", r = 4 }
max_steps = 6
batch_size = 8
max_length = 64
learning_rate = 3e-3
""")
    result = run_cli("run", str(plan))
    assert result.returncode == 0, result.stderr[-3000:]
    run = tiny_project.dir / "runs" / "tiny"
    summary = json.loads((run / "summary.json").read_text())
    dpo, rm = summary["stages"]["dpo"], summary["stages"]["rm"]
    assert dpo["reference_logp_max_diff"] < 1e-3 and dpo["eval_pairs"] == 16
    assert rm["eval_pairs"] == 16 and "eval_accuracy_before" in rm
    # The policy's adapter output holds the trained adapter only (no TRL `ref` adapter).
    assert (run / "stages" / "dpo" / "output" / "adapter_config.json").exists()
    assert not (run / "stages" / "dpo" / "output" / "ref").exists()
    report = json.loads((run / "data_report.json").read_text())
    assert any(k.startswith("dpo/train") for k in json.dumps(report).split('"'))
    from transformers import AutoModelForSequenceClassification

    AutoModelForSequenceClassification.from_pretrained(run / "stages" / "rm" / "output")


# -- the shared fixtures (real preference data) ---------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(not (SHARED / "data" / "dpo_en_demo.json").exists(), reason="../shared fixtures absent")
def test_real_dpo_and_kto_fixtures_render_and_train(tiny_project):
    data = SHARED / "data"
    plan = tiny_project(f"""
[data.dpo_demo]
use = "json"
path = "{data / 'dpo_en_demo.json'}"
limit = 24

[data.kto_demo]
use = "json"
path = "{data / 'kto_en_demo.json'}"
limit = 24

[[stage]]
name = "dpo"
trainer = "dpo"
data = "dpo_demo"
adapter = {{ use = "lora", r = 4 }}
max_steps = 2
batch_size = 4
max_length = 96

[[stage]]
name = "kto"
trainer = "kto"
data = "kto_demo"
adapter = {{ use = "lora", r = 4 }}
max_steps = 2
batch_size = 4
max_length = 96
""")
    result = run_cli("run", str(plan))
    assert result.returncode == 0, result.stderr[-3000:]
    run = tiny_project.dir / "runs" / "tiny"
    report = json.loads((run / "data_report.json").read_text())
    text = json.dumps(report)
    assert "dpo/train" in text and "kto/train" in text
    dpo = next(v for k, v in _flatten(report) if k.endswith("dpo/train"))
    assert dpo["rows"] == 24 and dpo["truncated"] + dpo["dropped"] > 0  # long real answers, max_length 96
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stages"]["dpo"]["global_step"] == 2 and summary["stages"]["kto"]["global_step"] == 2


def _flatten(value, prefix=""):
    if isinstance(value, dict):
        if "rows" in value and "kept" in value:
            yield prefix, value
        for k, v in value.items():
            yield from _flatten(v, f"{prefix}/{k}" if prefix else k)


@pytest.mark.slow
@pytest.mark.parametrize("trainer,adapter,data", [("dpo", '{ use = "lora", r = 4 }', "pairs"),
                                                  ("dpo", '"full"', "pairs"),
                                                  ("dpo", '{ use = "lora", r = 4 }', "dpo_demo"),
                                                  ("kto", '{ use = "lora", r = 4 }', "pairs"),
                                                  ("kto", '"full"', "dpo_demo"),
                                                  ("orpo", '"full"', "pairs"),
                                                  ("orpo", '{ use = "lora", r = 4 }', "dpo_demo")])
def test_padding_free_preference_trains_as_padded(tiny_project, trainer, adapter, data):
    """padding_free = true: the batch's sequences as one row (DPO and ORPO: chosen and rejected; KTO:
    completions and their KL counterparts); the same per-step losses, rewards and log-probs as the
    padded run (the issue's bound: 1e-5), with an adapter (DPO/KTO reference: adapters off) or full
    fine-tuning (reference: a copy), on synthetic pairs and on the real DPO demo set."""
    if data == "dpo_demo" and not (SHARED / "data" / "dpo_en_demo.json").exists():
        pytest.skip("../shared fixtures absent")
    rows = pair_rows(64, 0)
    for i, row in enumerate(rows):  # lengths that differ, so that the padded batches pad
        row["prompt"][0]["content"] += " please" * (i % 5)
        row["chosen"][0]["content"] += " indeed" * (i % 3)
    write_jsonl(tiny_project.dir / "pairs.jsonl", rows)
    write_jsonl(tiny_project.dir / "pairs_eval.jsonl", pair_rows(16, 1))
    metrics = {}
    for free in ("false", "true"):
        plan = tiny_project(PAIRS_DATA + f"""
[data.dpo_demo]
use = "json"
path = "{SHARED / 'data' / 'dpo_en_demo.json'}"
limit = 16

[[stage]]
name = "pref"
trainer = "{trainer}"
data = "{data}"
adapter = {adapter}
max_steps = 4
batch_size = 4
max_length = {512 if data == "dpo_demo" else 64}
learning_rate = 1e-3
logging_steps = 1
padding_free = {free}
""", name=f"free-{free}.toml")
        plan.write_text(plan.read_text().replace('name = "tiny"', f'name = "free-{free}"', 1)
                        .replace("max_position_embeddings = 128", "max_position_embeddings = 512", 1))
        result = run_cli("run", str(plan))
        assert result.returncode == 0, result.stderr[-3000:]
        rows = [json.loads(line) for line in
                (tiny_project.dir / "runs" / f"free-{free}" / "metrics.jsonl").read_text().splitlines()]
        metrics[free] = {r["step"]: r for r in rows if r.get("stage") == "pref" and "loss" in r and "step" in r}
        stage = json.loads((tiny_project.dir / "runs" / f"free-{free}" / "summary.json").read_text())["stages"]["pref"]
        if free == "true":  # every forward of the 4 steps ran as one row, padding left out
            # dpo, kto: policy and reference (kto: and their KL rows); orpo: the policy alone
            assert stage["padding_free_forwards"] >= (4 if trainer == "orpo" else 8) and stage["padding_free_pads"] > 0
        else:
            assert "padding_free_forwards" not in stage
    assert len(metrics["true"]) == 4 and metrics["true"].keys() == metrics["false"].keys()
    keys = {"dpo": ("loss", "rewards/margins", "logps/chosen"), "kto": ("loss", "kl", "logps/chosen", "rewards/chosen"),
            "orpo": ("loss", "rewards/margins", "logps/chosen", "nll_loss", "log_odds_ratio")}[trainer]
    for step, row in metrics["false"].items():
        for key in keys:
            if trainer == "kto" and key not in row:
                continue  # kto logs logps/rewards of a label only for steps whose batch has it
            # the loss within 1e-5; sums of a sequence's log-probs (logps) of up to 512 tokens in fp32 to 1e-5
            # relative, and kto's kl, a difference of two such sums, to 1e-4
            bound = pytest.approx(row[key], abs=1e-5) if key == "loss" else \
                pytest.approx(row[key], rel=1e-4 if key == "kl" else 1e-5, abs=1e-5)
            assert metrics["true"][step][key] == bound, (step, key)
    if trainer == "orpo":  # a mean over the padding: not reported when there is none
        assert "logits/chosen" in metrics["false"][1] and "logits/chosen" not in metrics["true"][1]
