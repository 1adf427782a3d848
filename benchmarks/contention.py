"""The quickstart's SFT steps/s alone and beside busy processes, in one run.

    python benchmarks/contention.py [--steps 60] [--busy 1] [--repeats 2] [--tiny]

A newcomer's machine is rarely idle. This trains the quickstart's model (its plan, with the
pre-training stage cut to 20 steps, SFT to ``--steps`` steps, no evaluation or export) with
``ftcore run``, alone and beside ``--busy`` processes that each keep one core busy (a Python
loop), arms alternating. Each arm runs twice: with ftcore's default (``OMP_WAIT_POLICY=PASSIVE``:
OpenMP threads sleep when they wait), and with ``GOMP_SPINCOUNT=300000``, libgomp's own default
when no wait policy is set (threads spin about 3 ms at every barrier before they sleep), which is
what ftcore ran with before. Steps/s is the SFT stage's ``global_step / train_seconds`` from its
``COMPLETE.json``.
``--tiny`` is the test's mode: one repeat of 4 SFT steps, without the pre-training stage.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
QUICKSTART = ROOT / "examples" / "quickstart"
BUSY = "while True:\n    pass\n"


def plan(folder: Path, name: str, steps: int, tiny: bool = False) -> Path:
    from ftcore.testing import to_toml

    raw = tomllib.loads((QUICKSTART / "plan.toml").read_text())
    raw["run"].update(name=name, output_dir=str(folder / "runs"))
    for data in raw["data"].values():
        data["path"] = str(QUICKSTART / data["path"])
    pretrain, sft = raw["stage"]
    pretrain.update(max_steps=20, save_steps=1000)
    sft.update(max_steps=steps, save_steps=1000)
    if tiny:  # the SFT stage alone (its steps/s is what is measured), on the scratch model as built
        raw["stage"] = [sft]
    raw.pop("evaluate", None)
    raw.pop("export", None)
    path = folder / f"{name}.toml"
    path.write_text(to_toml(raw))
    return path


def arm(folder: Path, name: str, steps: int, busy: int, env: dict[str, str], tiny: bool = False) -> float:
    competitors = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(busy)]
    try:
        r = subprocess.run([sys.executable, "-m", "ftcore", "run", str(plan(folder, name, steps, tiny))],
                           env={**os.environ, **env}, capture_output=True, text=True)
    finally:
        for p in competitors:
            p.kill()
            p.wait()
    if r.returncode != 0:
        sys.exit(f"contention: ftcore run failed:\n{r.stderr[-3000:]}")
    done = json.loads((folder / "runs" / name / "stages" / "sft" / "COMPLETE.json").read_text())["metrics"]
    return done["global_step"] / done["train_seconds"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--busy", type=int, default=1, help="busy processes beside the run")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    steps, repeats = (4, 1) if a.tiny else (a.steps, a.repeats)
    policies = {"passive (default)": {}, "spin 300k (before)": {"GOMP_SPINCOUNT": "300000"}}
    rates: dict[tuple[str, int], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="ftcore-contention-") as tmp:
        folder = Path(tmp)
        n = 0
        for r in range(repeats):
            for policy, env in (policies.items() if r % 2 == 0 else reversed(policies.items())):
                for busy in ((0, a.busy) if r % 2 == 0 else (a.busy, 0)):
                    n += 1
                    rates.setdefault((policy, busy), []).append(arm(folder, f"arm{n}", steps, busy, env, a.tiny))
    out = {f"{policy} / {busy} busy": statistics.median(v) for (policy, busy), v in rates.items()}
    if a.json:
        a.json.write_text(json.dumps({"rates": out, "steps": steps, "busy": a.busy}))
    print(f"quickstart SFT, {steps} steps, {os.cpu_count()} cores; median of {repeats} per arm")
    print(f"{'threads wait':<24} {'alone steps/s':>14} {f'{a.busy} busy steps/s':>16} {'slowdown':>9}")
    for policy in policies:
        alone, beside = statistics.median(rates[(policy, 0)]), statistics.median(rates[(policy, a.busy)])
        print(f"{policy:<24} {alone:>14.2f} {beside:>16.2f} {alone / beside:>8.2f}x")


if __name__ == "__main__":
    main()
