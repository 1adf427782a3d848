"""The PPO reward curve on a toy task, on CPU.

    python benchmarks/ppo_reward_curve.py [--steps 200] [--out ppo_curve]

A tiny scratch model (llama, 1 layer, hidden 32) is fine-tuned by SFT to answer "Which is an
animal? <three words>" with "the <animal>" (one of cat, dog, bird, fox); then ``ppo`` trains it
with the rule-based reward ``contains "cat"``: 1.0 when the completion names a cat. The SFT
model names the prompt's animal, so it starts near 1/4; a policy that learns to say "cat"
whatever the prompt reaches 1.0. The run goes through ``ftcore run`` like a user's.

Writes ``<out>/curve.json`` and ``<out>/curve.csv`` (step, mean reward, KL, KL coefficient,
entropy, clip fractions, losses), ``<out>/curve.png`` when matplotlib is installed, prints an
ASCII plot and the start / middle / end mean reward and KL (means over a tenth of the run each).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PLAN = """
[run]
name = "ppo-curve"
seed = 7

[model]
use = "scratch"
hidden_size = 32
num_layers = 1
num_heads = 2
intermediate_size = 64
max_position_embeddings = 128
tokenizer_data = ["chat"]
vocab_size = 300

[template]
use = "chatml"

[data.chat]
use = "jsonl"
path = "chat.jsonl"

[reward.cat]
use = "contains"
words = ["cat"]

[[stage]]
name = "sft"
trainer = "sft"
data = "chat"
max_steps = 60
batch_size = 16
max_length = 64
learning_rate = 3e-3
logging_steps = 20

[[stage]]
name = "ppo"
trainer = "ppo"
data = "chat"
reward = ["cat"]
max_steps = {steps}
batch_size = 16
max_new_tokens = 6
learning_rate = 1e-3
lr_scheduler = "constant"
ppo_epochs = 2
kl_coef = 0.05
kl_controller = "adaptive"
target_kl = {target_kl}
kl_horizon = 400
save_steps = 50
"""

COLUMNS = ["step", "reward/mean", "kl", "kl_coef", "entropy", "policy/clip_fraction", "value/clip_fraction",
           "loss/policy", "loss/value", "completion_length"]


def ascii_plot(values: list[float], label: str, height: int = 10, width: int = 60) -> str:
    """One line chart in text: columns are buckets of steps (their mean), rows value levels."""
    buckets = [values[i * len(values) // width:(i + 1) * len(values) // width] or [values[-1]] for i in range(width)]
    means = [sum(b) / len(b) for b in buckets]
    low, high = min(means), max(means)
    span = (high - low) or 1.0
    rows = []
    for level in range(height, -1, -1):
        y = low + span * level / height
        line = "".join("*" if round((m - low) / span * height) == level else " " for m in means)
        rows.append(f"{y:8.3f} |{line}")
    rows.append(" " * 9 + "+" + "-" * width)
    rows.append(" " * 10 + f"step 1 .. {len(values)}   ({label})")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--target-kl", type=float, default=4.0)
    parser.add_argument("--out", type=Path, default=Path("ppo_curve"))
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import chat_rows, write_jsonl

    work = Path(tempfile.mkdtemp(prefix="ftcore-ppo-curve-"))
    write_jsonl(work / "chat.jsonl", chat_rows(256))
    (work / "plan.toml").write_text(PLAN.format(steps=args.steps, target_kl=args.target_kl))
    env = {**os.environ, "FTCORE_CACHE_DIR": str(work / "cache"), "HF_DATASETS_CACHE": str(work / "hf-cache")}
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "ftcore", "run", str(work / "plan.toml")], cwd=ROOT, env=env,
                            capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"the run failed:\n{result.stderr[-3000:]}")

    run = work / "runs" / "ppo-curve"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    curve = [{k: r.get(k) for k in COLUMNS} for r in records if r["stage"] == "ppo" and "reward/mean" in r]
    stage = json.loads((run / "stages" / "ppo" / "COMPLETE.json").read_text())

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "curve.json").write_text(json.dumps({"plan": PLAN.format(steps=args.steps, target_kl=args.target_kl),
                                                     "final_metrics": stage["metrics"], "curve": curve}, indent=1))
    with (args.out / "curve.csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(curve)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 6))
        steps = [c["step"] for c in curve]
        top.plot(steps, [c["reward/mean"] for c in curve])
        top.set_ylabel("mean reward")
        bottom.plot(steps, [c["kl"] for c in curve])
        bottom.set_ylabel("KL (per sequence)")
        bottom.set_xlabel("PPO step")
        fig.savefig(args.out / "curve.png", dpi=100)
    except ImportError:
        pass

    rewards, kls = [c["reward/mean"] for c in curve], [c["kl"] for c in curve]
    n = len(curve)
    tenth = max(1, n // 10)
    mid = n // 2 - tenth // 2

    def window(values: list[float], at: int) -> float:
        part = values[at:at + tenth]
        return sum(part) / len(part)

    print(ascii_plot(rewards, "mean reward"))
    print()
    print(ascii_plot(kls, "KL"))
    print()
    print(f"{n} PPO steps x 16 rollouts in {seconds:.0f} s (whole run, SFT included); curve in {args.out}/")
    print(f"{'':8}{'steps':>12}{'reward':>10}{'KL':>10}{'kl_coef':>10}")
    for name, at in (("start", 0), ("middle", mid), ("end", n - tenth)):
        coef = curve[at + tenth - 1]["kl_coef"]
        print(f"{name:8}{f'{at + 1}-{at + tenth}':>12}{window(rewards, at):>10.3f}{window(kls, at):>10.3f}"
              f"{coef:>10.4f}")
    print(f"max KL over the run: {max(kls):.3f}")


if __name__ == "__main__":
    main()
