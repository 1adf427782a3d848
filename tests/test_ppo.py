"""Trainer ``ppo``: the algorithm's pieces against plain numpy loops, plan validation, and real runs
on a tiny scratch model (reward rises, resume continues bit for bit, reward-model source)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from conftest import run_cli

torch = pytest.importorskip("torch")

from ftcore_plugins.trainers import _ppo  # noqa: E402


def _batch(seed: int = 0):
    """Random per-token tensors for 3 rows of length 6, with responses of length 6, 3 and 1."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1] * 6, [1] * 3 + [0] * 3, [1] + [0] * 5], dtype=torch.float)
    return [torch.randn(3, 6, generator=g, dtype=torch.float64) for _ in range(4)], mask.double()


# -- the pieces against independent loops -------------------------------------------------------------------


def test_gae_matches_a_loop_over_each_rows_own_tokens():
    (rewards, values, _, _), mask = _batch()
    gamma, lam = 0.9, 0.8
    advantages, returns = _ppo.gae(rewards, values, mask, gamma, lam)
    for row in range(3):
        n = int(mask[row].sum())
        r, v = rewards[row, :n].numpy(), values[row, :n].numpy()
        expected, running = np.zeros(n), 0.0
        for t in range(n - 1, -1, -1):  # the episode ends after the row's last token: next value 0
            delta = r[t] + gamma * (v[t + 1] if t + 1 < n else 0.0) - v[t]
            running = delta + gamma * lam * running
            expected[t] = running
        np.testing.assert_allclose(advantages[row, :n].numpy(), expected, rtol=1e-12)
        np.testing.assert_allclose(returns[row, :n].numpy(), expected + v, rtol=1e-12)
        assert not advantages[row, n:].any() and not returns[row, n:].any()


def test_masked_whiten_uses_only_the_masked_entries():
    (values, _, _, _), mask = _batch(1)
    out = _ppo.masked_whiten(values, mask)
    picked = values.numpy()[mask.numpy() == 1]
    expected = (picked - picked.mean()) / np.sqrt(picked.var(ddof=1) + 1e-8)
    np.testing.assert_allclose(out.numpy()[mask.numpy() == 1], expected, rtol=1e-10)
    assert not out[mask == 0].any()


def test_clipped_policy_loss_and_clip_fraction_match_a_loop():
    (logp, old, adv, _), mask = _batch(2)
    logp = old + 0.5 * logp  # ratios spread around 1, many outside [0.8, 1.2]
    loss, clip = _ppo.policy_loss(logp, old, adv, mask, 0.2)
    terms, clipped = [], []
    for row in range(3):
        for t in range(int(mask[row].sum())):
            ratio = np.exp(float(logp[row, t] - old[row, t]))
            a = float(adv[row, t])
            plain, bounded = -a * ratio, -a * min(max(ratio, 0.8), 1.2)
            terms.append(max(plain, bounded))
            clipped.append(bounded > plain)
    assert loss.item() == pytest.approx(np.mean(terms), rel=1e-10)
    assert clip.item() == pytest.approx(np.mean(clipped), rel=1e-10)
    assert 0 < clip.item() < 1


def test_clipped_value_loss_and_clip_fraction_match_a_loop():
    (vpred, old, returns, _), mask = _batch(3)
    loss, clip = _ppo.value_loss(vpred, old, returns, mask, 0.2)
    terms, clipped = [], []
    for row in range(3):
        for t in range(int(mask[row].sum())):
            v, o, r = float(vpred[row, t]), float(old[row, t]), float(returns[row, t])
            vc = o + min(max(v - o, -0.2), 0.2)
            terms.append(max((v - r) ** 2, (vc - r) ** 2))
            clipped.append((vc - r) ** 2 > (v - r) ** 2)
    assert loss.item() == pytest.approx(0.5 * np.mean(terms), rel=1e-10)
    assert clip.item() == pytest.approx(np.mean(clipped), rel=1e-10)


def test_adaptive_kl_controller_follows_ziegler_and_fixed_stays():
    ctl = _ppo.AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(12.0, 256)  # error clipped to +0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000))
    ctl.update(5.4, 256)  # error -0.1
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000) * (1 - 0.1 * 256 / 10000))
    fixed = _ppo.FixedKLController(0.1)
    fixed.update(100.0, 256)
    assert fixed.value == 0.1


def test_text_rows_are_refused_in_one_line():
    import datasets

    from ftcore.errors import FtcoreError

    with pytest.raises(FtcoreError, match=r"stage p: trainer 'ppo' needs prompts.*this data has text"):
        _ppo.prompt_texts(datasets.Dataset.from_list([{"text": "hello"}]), None, None, "p")


# -- validation -------------------------------------------------------------------------------------------

PPO_STAGE = """
[reward.cat]
use = "contains"
words = ["cat"]

[[stage]]
name = "ppo"
trainer = "ppo"
data = "chat"
{extra}
"""


@pytest.mark.parametrize("extra, key, message", [
    ("", "stage[0].reward", "set exactly one reward source"),
    ('reward = ["cat"]\nreward_model = "rm"', "stage[0].reward_model", "no earlier stage is named 'rm'"),
    ('reward = ["dog"]', "stage[0].reward[0]", "undefined reward 'dog'"),
    ('reward = ["cat"]\nreward_weights = [1.0, 2.0]', "stage[0].reward_weights", "2 weights for 1 rewards"),
    ('reward = ["cat"]\nmax_new_tokens = 600', "stage[0].max_new_tokens", "leaves no room for the prompt"),
])
def test_validation_names_the_key(tiny_project, extra, key, message):
    result = run_cli("validate", str(tiny_project(PPO_STAGE.format(extra=extra))))
    assert result.returncode == 2
    line = next(line for line in result.stderr.splitlines() if message in line)
    assert f": {key}: " in line


def test_reward_model_must_name_an_earlier_reward_stage(tiny_project):
    later = PPO_STAGE.format(extra='reward_model = "sft"') + '\n[[stage]]\nname = "sft"\ntrainer = "sft"\ndata = "chat"\n'
    result = run_cli("validate", str(tiny_project(later)))
    assert result.returncode == 2 and "stage[0].reward_model: no earlier stage is named 'sft'" in result.stderr
    policy = '[[stage]]\nname = "sft"\ntrainer = "sft"\ndata = "chat"\n' + PPO_STAGE.format(extra='reward_model = "sft"')
    result = run_cli("validate", str(tiny_project(policy)))
    assert result.returncode == 2 and "stage[1].reward_model: stage 'sft' (trainer 'sft') trains the policy" \
        in result.stderr


# -- real runs ---------------------------------------------------------------------------------------------

TOY = """
[reward.cat]
use = "contains"
words = ["cat"]

[[stage]]
name = "sft"
trainer = "sft"
data = "chat"
max_steps = 50
batch_size = 16
max_length = 64
learning_rate = 3e-3
logging_steps = 25

[[stage]]
name = "ppo"
trainer = "ppo"
data = "chat"
reward = ["cat"]
max_steps = 24
batch_size = 8
gradient_accumulation_steps = 2
max_new_tokens = 6
learning_rate = 1e-3
lr_scheduler = "cosine"
warmup_ratio = 0.1
ppo_epochs = 2
kl_controller = "adaptive"
target_kl = 3.0
kl_horizon = 400
save_steps = 6
save_total_limit = 2
"""


def _ppo_records(run):
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["stage"] == "ppo" and "reward/mean" in r]


@pytest.mark.slow
def test_ppo_raises_a_rule_based_reward_and_resumes_exactly(tiny_project):
    """SFT teaches the toy task (name the prompt's animal: "cat" in about a quarter of the answers);
    PPO with the reward "contains cat" must raise that share clearly, with KL bounded. Then the
    state a kill after checkpoint-18 leaves (no stage marker, checkpoint-24 never written) is
    resumed, and steps 19-24 come out exactly as in the uninterrupted run."""
    from transformers import AutoModelForCausalLM

    plan = tiny_project(TOY)
    result = run_cli("run", str(plan))
    assert result.returncode == 0, result.stderr[-3000:]
    run = tiny_project.dir / "runs" / "tiny"
    records = _ppo_records(run)
    assert [r["step"] for r in records] == list(range(1, 25))
    rewards = [r["reward/mean"] for r in records]
    first, last = np.mean(rewards[:4]), np.mean(rewards[-4:])
    assert last > first + 0.25, rewards
    for r in records:
        for key in ("kl", "entropy", "policy/clip_fraction", "value/clip_fraction", "loss/policy", "loss/value",
                    "kl_coef", "lr"):
            assert np.isfinite(r[key]), (key, r)
        assert r["kl"] < 20  # bounded: the adaptive penalty holds the policy near the SFT model
    # The reference is a frozen copy of the SFT policy: identical at step 1, apart after updates (a
    # copy that kept SFTTrainer's forward patch would run on the live weights: KL 0 throughout).
    assert records[0]["kl"] == 0.0 and max(r["kl"] for r in records) > 0.1
    assert records[0]["lr"] < records[3]["lr"]  # warmup
    assert records[-1]["kl_coef"] != records[0]["kl_coef"]  # the adaptive controller moved
    metrics = json.loads((run / "stages" / "ppo" / "COMPLETE.json").read_text())["metrics"]
    assert metrics["global_step"] == 24 and metrics["reward_last"] > metrics["reward_first"]

    # The stage's output is a plain causal LM (no value head) that transformers loads.
    model = AutoModelForCausalLM.from_pretrained(run / "stages" / "ppo" / "output")
    assert not any("value_head" in n for n, _ in model.named_parameters())

    checkpoints = run / "stages" / "ppo" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint-12", "checkpoint-18"]  # limit 2
    saved = checkpoints / "checkpoint-18"
    assert {"trainable.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pt", "trainer_state.json",
            "COMPLETE.json"} <= {p.name for p in saved.iterdir()}
    assert json.loads((saved / "trainer_state.json").read_text())["step"] == 18

    (run / "stages" / "ppo" / "COMPLETE.json").unlink()
    shutil.rmtree(run / "stages" / "ppo" / "output")
    resumed = run_cli("run", str(plan), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from checkpoint-18" in resumed.stdout
    again = _ppo_records(run)[24:]
    assert [r["step"] for r in again] == list(range(19, 25))
    for before, after in zip(records[18:], again):
        for key in ("reward/mean", "kl", "kl_coef", "loss/policy", "loss/value", "entropy", "lr"):
            assert after[key] == pytest.approx(before[key], rel=1e-5, abs=1e-7), (key, before["step"])


@pytest.mark.slow
def test_ppo_with_a_reward_model_and_lora(tmp_path):
    """The reward-model source and the LoRA reference, in process: a sequence-classification model
    saved by save_pretrained (what a ``reward`` stage leaves in its output folder) scores
    prompt + completion, padded in batches as one by one; the reference is the adapter-disabled
    policy, so KL is exactly 0 before the first update and not after. (Whether PPO raises a
    reward is the contains-reward run's test: this random reward model gives no learnable signal
    in a few steps.)"""
    import datasets
    from transformers import AutoModelForSequenceClassification

    from conftest import chat_rows
    from ftcore.context import AdapterContext, LoadContext, StageContext
    from ftcore.reporter import Reporter
    from ftcore_plugins.adapters.lora import LoraAdapter
    from ftcore_plugins.models.scratch import ScratchModelLoader
    from ftcore_plugins.quantizers.none import NoQuantizer
    from ftcore_plugins.templates.chatml import ChatMLTemplate
    from ftcore_plugins.trainers.ppo import PPOTrainer

    metrics_path = tmp_path / "metrics.jsonl"
    reporter = Reporter(None, metrics_path, None, None)
    data = datasets.Dataset.from_list(chat_rows(32))
    from ftcore.context import RunInfo

    run = RunInfo(plan=type("Plan", (), {"seed": 0})(), run_dir=tmp_path)  # a single process, rank 0
    loader = ScratchModelLoader(ScratchModelLoader.Options(hidden_size=32, num_layers=1, num_heads=2,
                                                           intermediate_size=64, tokenizer_data=["chat"],
                                                           vocab_size=300))
    model, tok = loader.load(LoadContext(run, reporter, NoQuantizer(), seed=0, work_dir=tmp_path / "model",
                                         data={"chat": data}.__getitem__))
    template = ChatMLTemplate()
    model, tok = template.prepare(model, tok)

    # A reward model of the same shape, its score head scaled so scores differ clearly between texts.
    rm_dir = tmp_path / "rm"
    torch.manual_seed(1)
    config = model.config.__class__(**{**model.config.to_dict(), "num_labels": 1, "pad_token_id": tok.pad_token_id})
    reward_model = AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():
        reward_model.score.weight.mul_(100)
    reward_model.save_pretrained(rm_dir)
    tok.save_pretrained(rm_dir)

    scorer = _ppo.RewardModel(rm_dir, torch.device("cpu"), "ppo", "rm")
    texts = ["<|im_start|>user\nWhich is an animal? cat red tree<|im_end|>\n<|im_start|>assistant\nthe cat",
             "hello", "the red fox sees a blue stone and runs"]
    batched = scorer.score(texts, batch_size=3)  # padded together, as PPO scores a rollout
    one_by_one = [scorer.score([t], batch_size=1)[0] for t in texts]
    np.testing.assert_allclose(batched, one_by_one, rtol=1e-4, atol=1e-4)

    lora = LoraAdapter(LoraAdapter.Options(r=8, lora_alpha=16))
    policy = lora.apply(model, AdapterContext(run, reporter, NoQuantizer()))
    trainer = PPOTrainer(PPOTrainer.Options(reward_model="rm", max_steps=4, batch_size=8, max_new_tokens=6,
                                            learning_rate=3e-3, lr_scheduler="constant", ppo_epochs=2,
                                            save_steps=100))
    ctx = StageContext(run, reporter, "ppo", policy, tok, template, data, None, tmp_path / "stage",
                       tmp_path / "stage" / "checkpoints", None, 0, adapter=lora, outputs={"rm": rm_dir})
    result = trainer.train(ctx)

    records = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    records = [r for r in records if "reward/mean" in r]
    assert records[0]["kl"] == 0.0  # policy == adapter-disabled reference before the first update
    assert records[-1]["kl"] != 0.0
    assert len({r["reward/mean"] for r in records}) > 1  # the reward model's scores, not a constant
    assert result["global_step"] == 4
    assert ctx.model is policy and hasattr(ctx.model, "disable_adapter")  # the runner saves the LoRA policy
