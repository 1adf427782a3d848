"""tiled_mlp: the memory one long row's training takes with and without tiled MLPs, and the step time.

Each arm is ``ftcore run`` of the same plan in its own process (a fresh peak RSS): a scratch Llama, narrow but
with a wide MLP (hidden 256, intermediate 2048: the MLP's activations are 8x the hidden states), one chat row
of ``--tokens`` tokens, batch 1, LoRA, ``--steps`` steps. Memory is ftcore's own measure, from the run's
metrics.jsonl: the ``trained`` point's peak RSS minus the ``adapter applied`` point's RSS (what training
added). A step's time is the gap between consecutive steps' loss records (logging_steps = 1), the first
step (warm-up) left out. Untiled, each layer keeps its MLP's intermediate activations for the backward
(tokens x intermediate_size, a few tensors of them); tiled, only the MLP's input, and one shard's
intermediates exist at a time (ceil(tokens / hidden_size) shards), for one more MLP forward a step.

    python benchmarks/tiled_mlp.py [--tokens 8192] [--hidden 256] [--intermediate 2048] [--layers 2] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = ["cat", "dog", "horse", "tree", "red", "blue", "stone", "river", "green", "house", "cloud", "bird"]

PLAN = """
[run]
name = "{name}"
seed = 7
output_dir = "runs"

[model]
use = "scratch"
hidden_size = {hidden}
num_layers = {layers}
num_heads = 4
intermediate_size = {intermediate}
max_position_embeddings = {positions}
tokenizer_data = ["long"]
vocab_size = 512

[template]
use = "chatml"

[data.long]
use = "jsonl"
path = "long.jsonl"

[[stage]]
name = "s"
trainer = "sft"
data = "long"
adapter = "lora"
max_steps = {steps}
batch_size = 1
max_length = {positions}
logging_steps = 1
save_steps = 1000
tiled_mlp = {tiled}
"""


def arm(folder: Path, tiled: bool, args: argparse.Namespace) -> dict:
    name = "tiled" if tiled else "untiled"
    plan = folder / f"{name}.toml"
    plan.write_text(PLAN.format(name=name, hidden=args.hidden, layers=args.layers, intermediate=args.intermediate,
                                positions=args.tokens + 64, steps=args.steps, tiled=str(tiled).lower()))
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    e = subprocess.run([sys.executable, "-m", "ftcore", "estimate", plan.name, "--device", "cpu", "--json"], cwd=folder,
                       capture_output=True, text=True, env=env)
    if e.returncode:
        sys.exit(f"{name}: ftcore estimate failed:\n{e.stderr[-3000:]}")
    activations = json.loads(e.stdout)["stages"][0]["bytes"]["activations"] / 2**20
    started = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "ftcore", "run", plan.name], cwd=folder, capture_output=True, text=True,
                       env=env)
    if r.returncode:
        sys.exit(f"{name} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    records = [json.loads(line) for line in (folder / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    memory = {k: v for rec in records if rec["stage"] == "memory" for k, v in rec.items()}
    steps = [rec for rec in records if rec["stage"] == "s" and "loss" in rec]
    gaps = [b["time"] - a["time"] for a, b in zip(steps[1:], steps[2:])]
    tokens = next(rec["data/train_length_max"] for rec in records if "data/train_length_max" in rec)
    shards = next((rec["tiled_mlp_shards"] for rec in records if "tiled_mlp_shards" in rec), 1)
    return {"arm": name, "tokens": tokens, "shards": shards,
            "added_mib": memory["s: trained/peak_rss_mib"] - memory["s: adapter applied/rss_mib"],
            "estimate_activations_mib": activations,
            "step_s": statistics.median(gaps) if gaps else float("nan"),
            "losses": [round(rec["loss"], 5) for rec in steps], "wall_s": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ftcore-bench-tiled-") as tmp:
        folder = Path(tmp)
        rng = random.Random(0)  # one token a word (the tiny tokenizer learns every word whole)
        row = {"messages": [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(args.tokens - 20))},
                            {"role": "assistant", "content": "the cat"}]}
        (folder / "long.jsonl").write_text(json.dumps(row) + "\n")
        results = [arm(folder, tiled, args) for tiled in (False, True)]
    print(f"one row, hidden {args.hidden}, intermediate {args.intermediate}, {args.layers} layers, LoRA, batch 1, "
          f"{args.steps} steps; {os.cpu_count()} CPUs\n")
    print("| arm | tokens | shards | training added (peak RSS - RSS before), MiB | estimated activations, MiB | "
          "step, s | losses |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['arm']} | {r['tokens']} | {r['shards']} | {r['added_mib']:,.0f} | "
              f"{r['estimate_activations_mib']:,.0f} | {r['step_s']:.2f} | {r['losses']} |")
    untiled, tiled = results
    saved = untiled["added_mib"] - tiled["added_mib"]
    estimated = untiled["estimate_activations_mib"] - tiled["estimate_activations_mib"]
    print(f"\ntiled_mlp: {tiled['added_mib'] - untiled['added_mib']:+,.0f} MiB "
          f"({tiled['added_mib'] / untiled['added_mib']:.2f}x), step time {tiled['step_s'] / untiled['step_s']:.2f}x")
    print(f"saved by tiling: {saved:,.0f} MiB measured, {estimated:,.0f} MiB estimated "
          f"({100 * (estimated - saved) / saved:+.1f}%)" if saved > 0 else
          f"saved by tiling: {saved:,.0f} MiB measured (nothing to compare), {estimated:,.0f} MiB estimated")


if __name__ == "__main__":
    main()
