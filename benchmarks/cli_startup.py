"""How long users wait for the fast commands, beside the cost they avoid (importing torch).

    python benchmarks/cli_startup.py [--repeat 5]

Prints the median wall time of each command and its ratio to the import a training run
needs anyway, `python -c "import torch, transformers, trl, peft"`, all measured in this one run
on this machine. The commands take turns (one of each per round), so the load of a shared
machine hits all of them alike.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLAN = ROOT / "examples" / "quickstart" / "plan.toml"

REFERENCE = "python -c 'import torch, transformers, trl, peft' (reference)"
COMMANDS = {
    "ftcore --help": [sys.executable, "-m", "ftcore", "--help"],
    "ftcore plugins": [sys.executable, "-m", "ftcore", "plugins"],
    "ftcore validate quickstart": [sys.executable, "-m", "ftcore", "validate", str(PLAN)],
    REFERENCE: [sys.executable, "-c", "import torch, transformers, trl, peft"],
}


def seconds(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.repeat):
        for name, cmd in COMMANDS.items():
            times[name].append(seconds(cmd))
    reference = statistics.median(times[REFERENCE])
    print(f"{args.repeat} rounds, medians")
    print()
    print("| command | median s | min s | x reference |")
    print("|---|---:|---:|---:|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.3f} | {min(values):.3f} | "
              f"{statistics.median(values) / reference:.2f} |")


if __name__ == "__main__":
    main()
