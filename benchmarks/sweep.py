"""What a sweep's two savings are worth: the shared stages (trained once, base loaded once) and pruning.

    python benchmarks/sweep.py                 # examples/sweep/plan.toml: 12 TPE trials, three arms (~20 min)
    python benchmarks/sweep.py --tiny          # a 2-trial version on a smaller model, for the tests

Three arms of `ftcore sweep` on the same plan and space, one after another, each in its own folder:
  plain    pruner "none", share_stages false: every trial pre-trains and loads its own base;
  shared   pruner "none", share_stages true;
  pruned   pruner "median", share_stages true (the plan as written).
and the plan's own defaults once with `ftcore run`, the baseline the sweep should match or beat.
Prints trials finished and pruned, wall time per arm, the savings, and the best metric against the
defaults'. --json PATH writes the same numbers.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLAN = ROOT / "examples" / "sweep" / "plan.toml"
ARMS = {"plain": {"pruner": "none", "share_stages": False}, "shared": {"pruner": "none", "share_stages": True},
        "pruned": {"pruner": "median", "share_stages": True}}


def plan_for(work: Path, name: str, sweep: dict | None, tiny: bool) -> Path:
    """The example plan with absolute data paths, its runs under ``work``, and the arm's sweep options."""
    import tomllib

    import tomlkit

    raw = tomllib.loads(PLAN.read_text())
    raw["run"].update(name=name, output_dir=str(work / "runs"))
    for section in raw["data"].values():
        section["path"] = str((PLAN.parent / section["path"]).resolve())
    if tiny:  # a smaller model on fewer rows; the same stages, evaluations and space
        raw["model"].update(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
        raw["data"]["corpus"]["limit"] = 100
        raw["data"]["train"].update(limit=144, validation=16)  # 8 steps an epoch
        raw["data"]["eval"]["limit"] = 8
        raw["stage"][0]["epochs"] = 1
        raw["stage"][1].update(epochs=2, eval_steps=4, save_steps=8)  # 4 evaluations for the pruner to compare
        raw["sweep"].update(trials=2, prune_startup_trials=1)
    if sweep is None:
        raw.pop("sweep")
    else:
        raw["sweep"].update(sweep)
    path = work / f"{name}.toml"
    path.write_text(tomlkit.dumps(raw))
    return path


def ftcore(*args: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "ftcore", *args], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="2 trials on a smaller model (for the tests)")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--keep", type=Path, help="run in this folder and keep it (default: a temporary one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ftcore-sweep-bench-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        defaults = plan_for(work, "defaults", None, args.tiny)
        seconds = ftcore("run", str(defaults))
        summary = json.loads((work / "runs" / "defaults" / "summary.json").read_text())
        metric = json.loads(PLAN.read_text().split("metric = ")[1].split("\n")[0])  # "validation/perplexity"
        evaluation, _, key = metric.partition("/")
        results = {"metric": metric, "defaults": {"value": summary["evaluations"]["after"][evaluation][key],
                                                  "seconds": round(seconds, 1)}, "arms": {}}
        for arm in args.arms:
            seconds = ftcore("sweep", str(plan_for(work, arm, ARMS[arm], args.tiny)))
            done = json.loads((work / "runs" / arm / "sweep.json").read_text())
            states = _states(work / "runs" / arm / "study.db")
            results["arms"][arm] = {"wall_seconds": round(seconds, 1), "best": done["best"]["value"],
                                    "best_params": done["best"]["params"], "complete": states.get("COMPLETE", 0),
                                    "pruned": states.get("PRUNED", 0), "models": done.get("models"),
                                    "sweep_seconds": {k: round(v, 1) for k, v in done["seconds"].items()}}
    report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


def _states(db: Path) -> dict[str, int]:
    import sqlite3

    with sqlite3.connect(db) as con:
        return dict(con.execute("select state, count(*) from trials group by state").fetchall())


def report(results: dict) -> None:
    arms, base = results["arms"], results["defaults"]
    print(f"defaults (ftcore run): {results['metric']} = {base['value']:.4f} in {base['seconds']} s")
    print(f"| arm | finished | pruned | wall (s) | best {results['metric']} | best vs defaults |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, arm in arms.items():
        print(f"| {name} | {arm['complete']} | {arm['pruned']} | {arm['wall_seconds']} | {arm['best']:.4f} | "
              f"{arm['best'] / base['value']:.3f} |")
    if "plain" in arms and "shared" in arms:
        print(f"shared stages and base kept: {arms['shared']['wall_seconds'] / arms['plain']['wall_seconds']:.2f}x "
              f"the plain sweep's wall time")
    if "shared" in arms and "pruned" in arms:
        print(f"pruning on top: {arms['pruned']['wall_seconds'] / arms['shared']['wall_seconds']:.2f}x the shared "
              f"sweep's wall time")
    if "plain" in arms and "pruned" in arms:
        print(f"both: {arms['pruned']['wall_seconds'] / arms['plain']['wall_seconds']:.2f}x")


if __name__ == "__main__":
    main()
