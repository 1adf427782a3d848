"""Online RL trainers ``grpo`` and ``rloo``: each raises the mean reward of its own samples on a tiny
model (after a short SFT stage, so that completions are answers), with reward functions from the plan,
from a third-party plugin, and from a reward-model stage; plan mistakes are caught by validate."""

from __future__ import annotations

import json
import types

import pytest

from conftest import ROOT, chat_rows, installed, run_cli, write_jsonl

SFT_THEN = """
[reward.cat]
use = "contains"
words = ["cat"]

[[stage]]
name = "sft"
trainer = "sft"
data = "chat"
max_steps = 40
batch_size = 8
max_length = 64
learning_rate = 3e-3
logging_steps = 10
save_steps = 100

[[stage]]
name = "rl"
data = "chat"
max_steps = 30
batch_size = 16
num_generations = 4
max_completion_length = 8
max_length = 64
learning_rate = 5e-3
save_steps = 100
"""


def rl_records(run):
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["stage"] == "rl"]


@pytest.mark.slow
def test_grpo_raises_the_mean_reward_of_its_samples(tiny_project):
    # The SFT model answers "the <animal from the prompt>"; the reward asks for "cat" whatever the prompt,
    # which a quarter of the prompts hold: reachable, and far from solved at the start.
    plan = tiny_project(SFT_THEN + 'trainer = "grpo"\nreward = ["cat"]\nbeta = 0.02\n')
    result = run_cli("run", str(plan))
    assert result.returncode == 0, result.stderr[-3000:]
    run = tiny_project.dir / "runs" / "tiny"
    metrics = json.loads((run / "stages" / "rl" / "COMPLETE.json").read_text())["metrics"]
    steps = [r for r in rl_records(run) if "reward/mean" in r]

    assert [r["step"] for r in steps] == list(range(1, 31))  # the mean reward of every step
    assert all(r["reward/cat"] == r["reward/mean"] for r in steps)  # one function, weight 1
    assert metrics["generation_batches"] == 30 and metrics["reward_window"] == 7
    # reward_start/end are the completion-weighted means of the first/last 7 steps' rewards.
    first, last = [r["reward/mean"] for r in steps[:7]], [r["reward/mean"] for r in steps[-7:]]
    assert metrics["reward_start"] == pytest.approx(sum(first) / 7)
    assert metrics["reward_end"] == pytest.approx(sum(last) / 7)
    assert metrics["reward_end"] >= metrics["reward_start"] + 0.25, metrics
    # The KL reference is the policy as the stage got it: zero on the first step, then growing.
    kls = [r["kl"] for r in rl_records(run) if "kl" in r]
    assert abs(kls[0]) < 1e-4 and metrics["kl_end"] > metrics["kl_start"]
    assert "mean reward" in result.stdout


@pytest.mark.slow
def test_rloo_with_a_third_party_reward_function_and_weights(tiny_project):
    # target_length comes from the example plugin package (an entry point), registered through
    # register_reward_functions like the built-in contains.
    plan = tiny_project(SFT_THEN.replace("[reward.cat]", '[reward.short]\nuse = "target_length"\ntarget = 2\n\n'
                                                         "[reward.cat]")
                        + 'trainer = "rloo"\nreward = ["cat", "short"]\nreward_weights = [1.0, 0.5]\n')
    with installed(ROOT / "examples" / "ftcore-example-evaluator", "ftcore-example-evaluator",
                   tiny_project.dir):
        result = run_cli("run", str(plan))
    assert result.returncode == 0, result.stderr[-3000:]
    run = tiny_project.dir / "runs" / "tiny"
    manifest = json.loads((run / "manifest.json").read_text())
    assert any(p["dist"] == "ftcore-example-evaluator" for p in manifest["plugins"])
    metrics = json.loads((run / "stages" / "rl" / "COMPLETE.json").read_text())["metrics"]
    steps = [r for r in rl_records(run) if "reward/mean" in r]

    for r in steps:  # the logged reward is the weighted sum of the functions' means
        assert r["reward/mean"] == pytest.approx(r["reward/cat"] + 0.5 * r["reward/short"], abs=1e-5)
        assert 0.0 <= r["reward/short"] <= 1.0
    assert {"reward_start/short", "reward_end/cat", "kl_end"} <= set(metrics)
    assert metrics["reward_end"] >= metrics["reward_start"] + 0.2, metrics


@pytest.mark.slow
def test_grpo_scored_by_a_reward_stage_of_the_same_plan(tiny_project):
    # Preference pairs: the reward stage learns to prefer the animal; GRPO takes its prompts from the
    # same pairs (prompt messages) and is scored by that model alone.
    pairs = [{"prompt": row["messages"][:1], "chosen": row["messages"][1:],
              "rejected": [{"role": "assistant", "content": "the tree"}]} for row in chat_rows(48, seed=3)]
    write_jsonl(tiny_project.dir / "pairs.jsonl", pairs)
    plan = tiny_project("""
[data.pairs]
use = "jsonl"
path = "pairs.jsonl"

[[stage]]
name = "rm"
trainer = "reward"
data = "pairs"
max_steps = 8
batch_size = 8
max_length = 64
learning_rate = 3e-3

[[stage]]
name = "rl"
trainer = "grpo"
data = "pairs"
reward_model = "rm"
eval_data = "chat_eval"
max_steps = 3
batch_size = 8
num_generations = 4
max_completion_length = 6
max_length = 64
save_steps = 100
""")
    result = run_cli("run", str(plan))
    assert result.returncode == 0, result.stderr[-3000:]
    run = tiny_project.dir / "runs" / "tiny"
    steps = [r for r in rl_records(run) if "reward/rm" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["reward/mean"] == r["reward/rm"] for r in steps)
    assert any(r["reward/rm_std"] > 0 for r in steps)  # the model tells completions apart
    metrics = json.loads((run / "stages" / "rl" / "COMPLETE.json").read_text())["metrics"]
    assert metrics["generation_batches"] == 3  # training batches only, not the evaluation's
    # The held-out prompts (chat rows) were sampled and scored when training ended.
    evaluated = [r for r in rl_records(run) if "eval_reward/mean" in r]
    assert evaluated and metrics["eval_reward"] == evaluated[-1]["eval_reward/mean"]
    assert "eval_perplexity" not in metrics


def test_reward_model_stage_scores_completions_and_peft_reference_is_removed(tmp_path):
    """A reward model saved by an earlier stage (built here with save_pretrained) scores GRPO's samples;
    with a LoRA policy and beta > 0, TRL's frozen reference adapter is not left in the model."""
    import datasets
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from ftcore.context import AdapterContext, LoadContext, RunInfo, StageContext
    from ftcore.reporter import Reporter
    from ftcore_plugins.trainers._online import RewardModel
    from ftcore_plugins.adapters.lora import LoraAdapter
    from ftcore_plugins.models.scratch import ScratchModelLoader
    from ftcore_plugins.quantizers.none import NoQuantizer
    from ftcore_plugins.templates.chatml import ChatMLTemplate
    from ftcore_plugins.trainers.grpo import GRPOTrainer

    torch.manual_seed(0)
    run = RunInfo(plan=types.SimpleNamespace(seed=0), run_dir=tmp_path)  # the adapter seeds from plan.seed
    reporter = Reporter(None, tmp_path / "metrics.jsonl", None, None)
    data = {"chat": datasets.Dataset.from_list(chat_rows(16))}
    loader = ScratchModelLoader(ScratchModelLoader.Options(hidden_size=32, num_layers=1, num_heads=2,
                                                           tokenizer_data=["chat"], vocab_size=300))
    model, tok = loader.load(LoadContext(run, reporter, NoQuantizer(), seed=0, work_dir=tmp_path / "model",
                                         data=data.__getitem__))
    template = ChatMLTemplate()
    model, tok = template.prepare(model, tok)

    rm_dir = tmp_path / "stages" / "rm" / "output"
    config = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=2, vocab_size=len(tok), num_labels=1,
                                  pad_token_id=tok.pad_token_id)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(rm_dir)
    tok.save_pretrained(rm_dir)

    adapter = LoraAdapter(LoraAdapter.Options(r=4, lora_alpha=8))
    model = adapter.apply(model, AdapterContext(run, reporter, NoQuantizer()))
    ctx = StageContext(run, reporter, "rl", model, tok, template, data["chat"], None, tmp_path / "stage",
                       tmp_path / "stage" / "checkpoints", None, 0, adapter=adapter, outputs={"rm": rm_dir})

    # Batched scoring (right padding) gives each text the score it gets alone, and a completion that
    # ended on its own is scored with the template's end of turn, as the reward model saw answers.
    scorer = RewardModel("rm", rm_dir, ctx)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    prompts = ["<|im_start|>user\nWhich is an animal? red cat tree<|im_end|>\n<|im_start|>assistant\n"] * 3
    completions, ids = ["the cat", "the", "the red tree blue"], [[7, end], [7], [7, 8, 9]]
    together = scorer(prompts, completions, completion_ids=ids)
    alone = [scorer([p], [c], completion_ids=[i])[0] for p, c, i in zip(prompts, completions, ids)]
    assert together == pytest.approx(alone, abs=1e-5)
    assert scorer.turn_end == "<|im_end|>"
    direct = scorer.model(**scorer.tokenizer(prompts[0] + "the cat<|im_end|>", return_tensors="pt",
                                             add_special_tokens=False)).logits[0, 0].item()
    assert together[0] == pytest.approx(direct, abs=1e-5)

    trainer = GRPOTrainer(GRPOTrainer.Options(reward_model="rm", beta=0.02, max_steps=2, batch_size=4,
                                              num_generations=2, max_completion_length=6, max_length=64,
                                              save_steps=100))
    metrics = trainer.train(ctx)
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "reward/rm" in r] == [1, 2]
    assert metrics["generation_batches"] == 2 and "kl_end" in metrics
    assert list(ctx.model.peft_config) == ["default"]  # the "ref" copy TRL added for the KL is gone


def test_text_rows_have_no_prompt():
    import datasets

    from ftcore.errors import FtcoreError
    from ftcore_plugins.trainers._online import prompt_dataset
    from ftcore_plugins.trainers.rloo import RLOOTrainer

    ctx = types.SimpleNamespace(stage="rl")
    rows = datasets.Dataset.from_list([{"text": "the cat sat"}])
    with pytest.raises(FtcoreError, match=r"^stage rl: trainer 'rloo' needs prompts: .* this train data has text; "
                                          "plain text rows have no prompt to answer$"):
        prompt_dataset(ctx, "rloo", rows, "train", RLOOTrainer.Options(reward=["x"]))


ONE_STAGE = """
[reward.cat]
use = "contains"
words = ["cat"]

[[stage]]
name = "first"
trainer = "sft"
data = "chat"

[[stage]]
name = "rl"
trainer = "{trainer}"
data = "chat"
{options}
"""


@pytest.mark.parametrize("trainer, options, expected", [
    ("grpo", "", "stage[1].reward: trainer 'grpo' needs a reward source"),
    ("rloo", 'reward = ["dog"]', "stage[1].reward[0]: undefined reward 'dog'"),
    ("grpo", 'reward_model = "later"', "stage[1].reward_model: no earlier stage is named 'later'; "
                                       "earlier stages: first"),
    ("grpo", 'reward_model = "nowhere"', "stage[1].reward_model: no earlier stage is named 'nowhere'"),
    ("rloo", 'reward = ["cat"]\nreward_weights = [1.0, 2.0]',
     "stage[1].reward_weights: 2 weight(s) for 1 reward source(s)"),
    ("grpo", 'reward = ["cat"]\nbatch_size = 6\nnum_generations = 4',
     "stage[1].batch_size: batch_size x gradient_accumulation_steps = 6 x 1 = 6 completions per generation batch "
     "must be a multiple of num_generations (4)"),
    ("grpo", 'reward = ["cat"]\nbatch_size = 4\nnum_generations = 4\nmax_completion_length = 600',
     "stage[1].max_completion_length: 600 leaves no room for the prompt within max_length (512)"),
])
def test_validate_names_the_key(tiny_project, trainer, options, expected):
    from ftcore.errors import PlanError
    from ftcore.plan import load_plan
    from ftcore.plugins import get_plugin_manager

    body = ONE_STAGE.format(trainer=trainer, options=options)
    if "later" in options:
        body += '\n[[stage]]\nname = "later"\ntrainer = "sft"\ndata = "chat"\n'
    with pytest.raises(PlanError) as err:
        load_plan(tiny_project(body), get_plugin_manager().registry())
    assert any(p.split(": ", 1)[1].startswith(expected) for p in err.value.problems), err.value.problems


def test_validate_cli_exit_code(tiny_project):
    result = run_cli("validate", str(tiny_project(ONE_STAGE.format(trainer="rloo", options=""))))
    assert result.returncode == 2
    assert "stage[1].reward: trainer 'rloo' needs a reward source" in result.stderr


def test_a_valid_plan_validates(tiny_project):
    body = ONE_STAGE.format(trainer="grpo", options='reward = ["cat"]\nbatch_size = 8\nnum_generations = 4\n'
                                                    'max_completion_length = 32')
    result = run_cli("validate", str(tiny_project(body)))
    assert result.returncode == 0, result.stderr
    assert "rl (grpo, full)" in result.stdout

