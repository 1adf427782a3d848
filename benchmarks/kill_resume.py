"""SIGKILL a run at random points, resume it, and check that the run records stay true.

    python benchmarks/kill_resume.py [--trials 20] [--seed 0] [--keep DIR]

A tiny two-stage plan (pre-training, then LoRA SFT with checkpoints every 3 steps, one kept, so old
ones are rotated away; a merged export) runs once uninterrupted for reference. Each trial starts the
same plan, kills it with SIGKILL at one of these moments, then runs ``--resume`` until it completes:

* ``loading``: 0 to 4 s after the start (imports, data, the model), or at the first logged step if that
  comes sooner (a run forked from a process that imported the libraries, as the tests start it, loads in
  less);
* ``steps``: once a random number of training steps is logged;
* ``checkpoint``: while a checkpoint folder exists without its COMPLETE.json (being written);
* ``rotation``: while more checkpoints are on disk than the plan keeps (an old one being deleted);
* ``export``: while the merged export is being written (its hidden ``.merged.partial`` folder).

The kinds take turns; where the run is, within a kind, is random. After each trial:

* every step's loss (the last attempt's record of each step) equals the reference run's (1e-6);
* the final weights (the merged export) equal the reference's (1e-6);
* ``summary.json``'s stage totals (train_loss, train_tokens, global_step) equal the reference's;
* the report's loss series has one point per step;
* ``exports/merged`` was never seen partial: when it exists, it holds every file of the reference's.

``tests/test_kill_resume.py`` runs one trial of each kind.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("loading", "steps", "checkpoint", "rotation", "export")
QUIET = {**os.environ, "OMP_NUM_THREADS": "1"}  # the same numerics in every process


def write_project(folder: Path) -> Path:
    from ftcore.testing import write_plan

    stages = [
        {"name": "pretrain", "trainer": "pretrain", "data": "text", "adapter": "full", "max_steps": 6,
         "batch_size": 8, "max_length": 64, "learning_rate": 3e-3, "logging_steps": 1, "save_steps": 3,
         "save_total_limit": 1, "precision": "fp32"},
        {"name": "sft", "trainer": "sft", "data": "chat", "adapter": {"use": "lora", "r": 8}, "max_steps": 12,
         "batch_size": 4, "max_length": 64, "learning_rate": 3e-3, "logging_steps": 1, "save_steps": 3,
         "save_total_limit": 1, "precision": "fp32"},
    ]
    return write_plan(folder, {"stage": stages}, '[[export]]\nuse = "merged"\n')


def start(plan: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ftcore", "run", str(plan), *extra], env=QUIET,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def logged_steps(run: Path) -> int:
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    return sum('"loss"' in line and '"step": null' not in line for line in lines)


def checkpoints(run: Path) -> list[Path]:
    return [c for s in ("pretrain", "sft") for c in (run / "stages" / s / "checkpoints").glob("checkpoint-*")]


def moment(kind: str, run: Path, rng: random.Random, total_steps: int):
    """A predicate that turns true at a point of the given kind."""
    if kind == "loading":
        deadline = time.monotonic() + rng.uniform(0, 4)
        return lambda: time.monotonic() >= deadline or logged_steps(run) >= 1
    if kind == "steps":
        n = rng.randint(1, total_steps - 1)
        return lambda: logged_steps(run) >= n
    if kind == "checkpoint":
        return lambda: any(not (c / "COMPLETE.json").exists() for c in checkpoints(run))
    if kind == "rotation":
        return lambda: sum(1 for c in checkpoints(run) if c.parent.parent.name == "sft") > 1
    if kind == "export":
        return lambda: (run / "exports" / ".merged.partial").exists()
    raise ValueError(kind)


def records(run: Path) -> dict[tuple[str, int], float]:
    from ftcore_plugins.commands.report import read_records

    out = {}
    for r in read_records(run):
        if "loss" in r and r.get("step") is not None and r["stage"] in ("pretrain", "sft"):
            key = (r["stage"], r["step"])
            assert key not in out, f"two points for {key} after latest_attempts"
            out[key] = r["loss"]
    return out


def weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def compare(run: Path, reference: Path) -> list[str]:
    """What differs from the reference run (empty: nothing)."""
    problems = []
    got, want = records(run), records(reference)
    if set(got) != set(want):
        problems.append(f"steps {sorted(set(got) ^ set(want))} differ")
    problems += [f"loss at {k}: {got[k]} vs {want[k]}" for k in sorted(set(got) & set(want))
                 if abs(got[k] - want[k]) > 1e-6]
    a, b = weights(run / "exports" / "merged"), weights(reference / "exports" / "merged")
    worst = max(float((a[k] - b[k]).abs().max()) for k in b)
    if set(a) != set(b) or worst > 1e-6:
        problems.append(f"final weights differ by {worst:.3g}")
    s, r = (json.loads((x / "summary.json").read_text())["stages"] for x in (run, reference))
    for stage in ("pretrain", "sft"):
        for key in ("global_step", "train_tokens"):
            if s[stage].get(key) != r[stage].get(key):
                problems.append(f"summary {stage}.{key}: {s[stage].get(key)} vs {r[stage].get(key)}")
        if abs(s[stage]["train_loss"] - r[stage]["train_loss"]) > 1e-6:
            problems.append(f"summary {stage}.train_loss: {s[stage]['train_loss']} vs {r[stage]['train_loss']}")
    return problems


def trial(folder: Path, kind: str, rng: random.Random, reference: Path, total_steps: int) -> dict:
    plan = write_project(folder)
    run = folder / "runs" / "tiny"
    proc = start(plan)
    ready = moment(kind, run, rng, total_steps)
    partial_seen = False
    while proc.poll() is None and not ready():
        time.sleep(0.005)
    killed = proc.poll() is None
    if killed:
        proc.send_signal(signal.SIGKILL)
    proc.communicate()
    merged = run / "exports" / "merged"
    expected_files = sorted(p.name for p in (reference / "exports" / "merged").iterdir())
    if merged.exists() and sorted(p.name for p in merged.iterdir()) != expected_files:
        partial_seen = True
    resumes = 0
    while (json.loads((run / "manifest.json").read_text()) if (run / "manifest.json").exists() else {}) \
            .get("status") != "complete":
        resumes += 1
        result = subprocess.run([sys.executable, "-m", "ftcore", "run", str(plan), "--resume"], env=QUIET,
                                capture_output=True, text=True)
        if result.returncode != 0 or resumes > 3:
            return {"kind": kind, "killed": killed, "problems": [f"resume failed: {result.stderr[-500:]}"]}
    problems = compare(run, reference)
    if partial_seen:
        problems.append("exports/merged was partial after the kill")
    return {"kind": kind, "killed": killed, "resumes": resumes, "problems": problems}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", nargs="*", default=list(KINDS), choices=KINDS)
    parser.add_argument("--keep", type=Path, help="keep the run folders here")
    parser.add_argument("--json", type=Path, help="also write the trials' results here")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    root = Path(args.keep or tempfile.mkdtemp(prefix="ftcore-kill-"))
    reference_plan = write_project(root / "reference")
    subprocess.run([sys.executable, "-m", "ftcore", "run", str(reference_plan)], env=QUIET, check=True,
                   capture_output=True)
    reference = root / "reference" / "runs" / "tiny"
    total = len(records(reference))
    results = []
    start_time = time.perf_counter()
    for i in range(args.trials):
        kind = args.kinds[i % len(args.kinds)]
        result = trial(root / f"trial-{i:02d}", kind, rng, reference, total)
        results.append(result)
        print(f"trial {i:2d} {kind:>10}: {'killed' if result['killed'] else 'ended before the moment'}, "
              f"{result.get('resumes', 0)} resume(s): {'; '.join(result['problems']) or 'same as the reference'}",
              flush=True)
    killed = sum(r["killed"] for r in results)
    bad = [r for r in results if r["problems"]]
    print(f"{len(results)} trials, {killed} killed mid-run, {len(bad)} with a difference "
          f"({time.perf_counter() - start_time:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return results


if __name__ == "__main__":
    sys.exit(1 if any(r["problems"] for r in main()) else 0)
