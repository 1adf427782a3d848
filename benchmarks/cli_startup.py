"""How long users wait for the fast commands, beside the cost they avoid (importing torch).

    python benchmarks/cli_startup.py [--repeat 5]

Prints the median wall time of each command and its ratio to `python -c "import torch"`,
all measured in this one run on this machine.
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

COMMANDS = {
    "ftcore --help": [sys.executable, "-m", "ftcore", "--help"],
    "ftcore plugins": [sys.executable, "-m", "ftcore", "plugins"],
    "ftcore validate quickstart": [sys.executable, "-m", "ftcore", "validate", str(PLAN)],
    "python -c 'import torch' (reference)": [sys.executable, "-c", "import torch"],
    "python -c 'import transformers, torch' (reference)": [sys.executable, "-c", "import torch, transformers"],
}


def median_seconds(cmd: list[str], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    results = {name: median_seconds(cmd, args.repeat) for name, cmd in COMMANDS.items()}
    torch_time = results["python -c 'import torch' (reference)"]
    print(f"{'command':55} {'median s':>9} {'x import torch':>15}")
    for name, seconds in results.items():
        print(f"{name:55} {seconds:9.3f} {seconds / torch_time:15.2f}")


if __name__ == "__main__":
    main()
