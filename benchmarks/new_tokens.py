"""Templates whose tokens are new to the tokenizer against `chatml`, on the quickstart plan, over seeds.

    python benchmarks/new_tokens.py [--seeds 1 2 3 4 5] [--arms chatml chatml-new llama3] [--jobs 2]
                                    [--json FILE] [--tiny]

The plan is examples/quickstart/plan.toml as it is (a scratch Llama with a BPE tokenizer trained on the
data, pre-trained 3 epochs, then LoRA r 4 for 10 epochs with ``train_template_tokens = true``; exact match
on the 100 held-out prompts), run once per seed and arm with ``[run] seed`` set; only its exports are
left out (they do not change the evaluation). The arms:

* ``chatml``: the quickstart itself. Its tokenizer is trained with ``<|im_start|>`` and ``<|im_end|>``
  among its special tokens, so the template adds nothing: those rows are the model's own (random at
  initialisation, never a target in pre-training), and ``train_template_tokens`` trains them under LoRA.
* ``chatml-new``: the same text, the same template, but the tokenizer is trained without those two
  tokens (``[model] special_tokens = []``), so the template adds them: the embedding grows, the two new
  rows are drawn by ``add_special_tokens`` and trained under LoRA as peft's trainable tokens.
* ``chatml-frozen``: the quickstart with ``train_template_tokens = false``: chatml's markers stay frozen
  under LoRA, as every LoRA stage leaves the rows of tokens the tokenizer had.
* ``llama3``: another template whose four markers (``<|begin_of_text|>``, ``<|start_header_id|>``,
  ``<|end_header_id|>``, ``<|eot_id|>``) are all new to the tokenizer.

Exact match counts an answer only when generation stops right after it, so it also shows whether the
new end-of-turn token was learned. The comparison is the mean over seeds (a single seed says little);
``stopped`` counts the answers that are "the <word>" and nothing after. ``--tiny`` (the test's mode):
one seed, 2 steps per stage, 64 rows of each data file and 10 held-out prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from _bench import machine, print_seed_table  # noqa: E402

QUICKSTART = ROOT / "examples" / "quickstart"
ARMS = ("chatml", "chatml-new", "llama3", "chatml-frozen")


def plan_text(seed: int, arm: str, name: str, output: Path, tiny: bool) -> str:
    """The quickstart's plan for one seed and arm, reading its data where it is and writing to ``output``."""
    text = (QUICKSTART / "plan.toml").read_text(encoding="utf-8")
    text = text.split("\n[[export]]", 1)[0] + "\n"
    edits = [(r'^seed = \d+', f"seed = {seed}"), (r'^name = "quickstart"', f'name = "{name}"'),
             (r'^output_dir = "runs".*$', f'output_dir = "{output.as_posix()}"'),
             (r'^use = "chatml"', f'use = "{"llama3" if arm == "llama3" else "chatml"}"')]
    if arm in ("chatml-new", "llama3"):
        edits.append((r'^vocab_size = (\d+)', r'vocab_size = \1\nspecial_tokens = []'))
    if arm == "chatml-frozen":
        edits.append((r'train_template_tokens = true', 'train_template_tokens = false'))
    for old, new in edits:
        text, n = re.subn(old, new, text, count=1, flags=re.M)
        assert n == 1, old
    text, n = re.subn(r'path = "data/', f'path = "{(QUICKSTART / "data").as_posix()}/', text)
    assert n == 3, n
    if tiny:  # 2 steps a stage on a few rows: the plumbing, not the numbers
        text, n = re.subn(r"^epochs = \d+", "max_steps = 2", text, flags=re.M)
        assert n == 2, n
        text, n = re.subn(r'^(path = ".*/data/(\w+)\.jsonl")$',
                          lambda m: m.group(1) + f"\nlimit = {10 if m.group(2) == 'eval' else 64}", text, flags=re.M)
        assert n == 3, n
    return text


def run_one(seed: int, arm: str, work: Path, tiny: bool) -> dict:
    name = f"{arm}-{seed}"
    plan = work / f"{name}.toml"
    plan.write_text(plan_text(seed, arm, name, work / "runs", tiny), encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "ftcore", "run", str(plan)], capture_output=True, text=True, env=env)
    if r.returncode:
        raise RuntimeError(f"{name} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    run = work / "runs" / name
    answers = [json.loads(line) for line in
               (run / "evaluations" / "after" / "exact_match" / "predictions.jsonl").read_text().splitlines()]
    scores = json.loads((run / "evaluations" / "after.json").read_text())["exact_match"]
    def specials(folder: Path) -> list[str]:
        return [t["content"] for t in json.loads((folder / "tokenizer.json").read_text())["added_tokens"]]

    trained = specials(run / "model" / "tokenizer")  # the loader's tokenizer, before the template
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    sft = [r["loss"] for r in records if r.get("stage") == "sft" and "loss" in r and r.get("step")]
    return {"seed": seed, "arm": arm, "exact_match": scores["exact_match"], "answers": len(answers),
            "stopped": sum(bool(re.fullmatch(r"the [a-z]+", a["prediction"].strip())) for a in answers),
            "added": [t for t in specials(run / "stages" / "sft" / "output") if t not in trained],
            "sft_last_loss": sft[-1] if sft else None,  # the last logged SFT loss: was the end of turn learned?
            "seconds": round(time.perf_counter() - start, 1)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (each with OMP_NUM_THREADS=1 unless set)")
    p.add_argument("--json", type=Path)
    p.add_argument("--tiny", action="store_true", help="one seed, 2 steps per stage on 64 rows, 10 prompts (the test's mode)")
    a = p.parse_args(argv)
    seeds = a.seeds[:1] if a.tiny else a.seeds
    arms = a.arms if "chatml" in a.arms else ["chatml", *a.arms]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ftcore-new-tokens-") as tmp:
        jobs = [(seed, arm) for seed in seeds for arm in arms]
        with ThreadPoolExecutor(max(1, a.jobs)) as pool:
            futures = [pool.submit(run_one, seed, arm, Path(tmp), a.tiny) for seed, arm in jobs]
            results = []
            for f in futures:
                results.append(f.result())
                print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    of = {arm: [r["exact_match"] for r in results if r["arm"] == arm] for arm in arms}
    mean = {arm: statistics.mean(v) for arm, v in of.items()}
    std = {arm: statistics.stdev(v) if len(v) > 1 else 0.0 for arm, v in of.items()}
    print(f"machine: {machine()}")
    print(f"plan: examples/quickstart/plan.toml without its exports{' (tiny: 2 steps per stage)' if a.tiny else ''}; "
          f"seeds {', '.join(map(str, seeds))}; {time.perf_counter() - start:.0f} s")
    print()
    print_seed_table(results, seeds, arms, arm_key="arm", stopped="stopped")
    print("| mean | " + " | ".join(f"{mean[arm]:.3f} | " for arm in arms) + "|")
    print("| std | " + " | ".join(f"{std[arm]:.3f} | " for arm in arms) + "|")
    print()
    for arm in arms:
        losses = [r["sft_last_loss"] for r in results if r["arm"] == arm and r["sft_last_loss"] is not None]
        if losses:
            print(f"{arm}: last logged SFT loss {min(losses):.3f} to {max(losses):.3f} (mean "
                  f"{statistics.mean(losses):.3f})")
    print()
    for arm in arms[1:]:
        print(f"{arm} - chatml, mean exact match over {len(seeds)} seed(s): {mean[arm] - mean['chatml']:+.3f}")
    out = {"results": results, "mean": mean, "std": std}
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
