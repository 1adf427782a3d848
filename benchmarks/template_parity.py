"""A plugin chat template against `chatml` on the quickstart task, over several seeds.

    python benchmarks/template_parity.py [--seeds 1 2 3 4 5 6 7 8] [--json FILE] [--tiny]

The plan is examples/ftcore-example-data/plan.toml: the quickstart's task (name the animal among
three words) with its rows read by the example package's `tsv` source, pre-trained from scratch, then
LoRA SFT. Each seed runs it twice, once with the package's `turns` template, whose markers
(<|turn|>, <|end|>) are new to the tokenizer, and once with `chatml`. Exact match counts an answer
only when the model stops right after it, so it shows whether <|end|> was learned under LoRA.

A single seed says little: the task is learned at some seeds and not at others, whatever the
template. The comparison is the mean over seeds, and how many answers stop right after the answer.

The package is installed (a copy, `pip install --no-deps --target`) into a scratch folder that only
this script's runs see. ``--tiny`` (the test's mode): one seed, 10 steps per stage on 256 rows of each
training file (the 100 held-out prompts as they are).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from _bench import machine, print_seed_table  # noqa: E402

EXAMPLE = ROOT / "examples" / "ftcore-example-data"
QUICKSTART = ROOT / "examples" / "quickstart"
TEMPLATES = ("turns", "chatml")


def install(site: Path, work: Path) -> None:
    """The example package into ``site`` (from a copy, so its build leaves nothing in the repository)."""
    source = work / "pkg"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("runs", "build", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
                    str(site), str(source)], check=True, capture_output=True, text=True)


def plan_text(seed: int, template: str, name: str, output: Path, tiny: bool) -> str:
    text = (EXAMPLE / "plan.toml").read_text(encoding="utf-8")
    text = text.replace('"../quickstart/', f'"{QUICKSTART.as_posix()}/')
    text = text.replace('"data/train.tsv"', f'"{(EXAMPLE / "data" / "train.tsv").as_posix()}"')
    text = text.replace('output_dir = "runs"', f'output_dir = "{output.as_posix()}"')
    for old, new in ((r'^seed = \d+', f"seed = {seed}"), (r'^name = "example-data"', f'name = "{name}"'),
                     (r'^use = "turns"', f'use = "{template}"')):
        text, n = re.subn(old, new, text, count=1, flags=re.M)
        assert n == 1, old
    if tiny:  # the plumbing, not the numbers
        text, n = re.subn(r"^epochs = \d+", "max_steps = 10", text, flags=re.M)
        assert n == 2, n
        text, n = re.subn(r'^(path = ".*/(corpus\.jsonl|train\.tsv)")$', r"\1\nlimit = 256", text, flags=re.M)
        assert n == 2, n
    return text


def run_one(seed: int, template: str, work: Path, env: dict, tiny: bool) -> dict:
    name = f"{template}-{seed}"
    plan = work / f"{name}.toml"
    plan.write_text(plan_text(seed, template, name, work / "runs", tiny), encoding="utf-8")
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "ftcore", "run", str(plan)], capture_output=True, text=True,
                       env=env)
    if r.returncode:
        sys.exit(f"{name} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    run = work / "runs" / name
    answers = [json.loads(line) for line in
               (run / "evaluations" / "after" / "answers" / "predictions.jsonl").read_text().splitlines()]
    scores = json.loads((run / "evaluations" / "after.json").read_text())["answers"]
    return {"seed": seed, "template": template, "exact_match": scores["exact_match"], "answers": len(answers),
            "stopped": sum(bool(re.fullmatch(r"the [a-z]+", a["prediction"])) for a in answers),
            "seconds": time.perf_counter() - start}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7, 8])
    p.add_argument("--json", type=Path)
    p.add_argument("--tiny", action="store_true", help="one seed, 10 steps per stage on 256 rows (the test's mode)")
    a = p.parse_args()
    seeds = a.seeds[:1] if a.tiny else a.seeds
    results = []
    with tempfile.TemporaryDirectory(prefix="ftcore-template-parity-") as tmp:
        work = Path(tmp)
        install(work / "site", work)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(work / "site"),
                                                                          os.environ.get("PYTHONPATH")]))}
        for seed in seeds:
            for template in TEMPLATES:
                results.append(run_one(seed, template, work, env, a.tiny))
                print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    mean = {t: statistics.mean(r["exact_match"] for r in results if r["template"] == t) for t in TEMPLATES}
    print(f"machine: {machine()}")
    print(f"plan: {EXAMPLE.relative_to(ROOT)}/plan.toml{' (tiny: 10 steps per stage on 256 rows)' if a.tiny else ''}; "
          f"seeds {', '.join(map(str, seeds))}")
    print()
    print_seed_table(results, seeds, TEMPLATES, arm_key="template", stopped="stopped after the answer")
    print(f"| mean | {mean['turns']:.3f} | | {mean['chatml']:.3f} | |")
    print()
    print(f"turns - chatml, mean exact match over {len(seeds)} seed(s): {mean['turns'] - mean['chatml']:+.3f}")
    if a.json:
        a.json.write_text(json.dumps({"results": results, "mean": mean}, indent=1))


if __name__ == "__main__":
    main()
