"""Per-rank activation memory under sequence parallelism: one process against ``sp_size = 2``.

    python benchmarks/sequence_parallel_memory.py [--lengths 4096 8192] [--steps 4] [--tiny] [--json PATH]
                                                  [--jsonl PATH] [--keep DIR]

A pretrain stage on a tiny scratch Llama (hidden 64, 4 layers, 4 heads, 2 key/value heads, MLP 256, fp32, full
fine-tuning, no gradient checkpointing: the defaults; the chunked loss) on the quickstart's corpus cut into rows
of each ``--length`` tokens, batch 1, ``--steps`` steps: the weights, their gradients and the optimizer state
are about 4 MiB, so what a step adds is its activations. Each length is trained by

- ``sp1``: one process;
- ``sp2``: two processes with ``sp_size = 2`` (``engine = "deepspeed"``, ZeRO-2, gloo): each holds half of
  every row's columns, and inside attention the whole row for half of the heads;

each as ``ftcore run`` in a process of its own, one run after another. Measured per run, on rank 0 (ftcore
records it: ``summary.json`` -> ``memory``): the peak RSS while the stage trained (``"pretrain: trained"``
``peak_rss_mib``) minus the RSS before (``"pretrain: adapter applied"`` ``rss_mib``). That difference also holds
what training sets up whatever the row's length (the Trainer, DeepSpeed's engine and import, the optimizer
state): a control run of each arm on rows of ``CONTROL`` tokens measures it, and the **activation memory** is the
difference of the two (the control's own activations, small, are in both the measured and the estimated
differences). Every worker's peak RSS (``VmHWM``, which each rank resets as training starts) is also sampled
from ``/proc`` every 0.1 s until it exits (so it also holds what follows training: saving the model): rank 1's
beside rank 0's says whether rank 0 stands for both.

Against it: ``ftcore estimate PLAN --json``'s ``activations`` for the same plans, the difference at the length
and the control, and its error. ``--tiny`` (the test's mode): one length, 4096, 2 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from _bench import machine  # noqa: E402

MiB = 2**20
CONTROL = 256
DATA = ROOT / "examples" / "quickstart" / "data" / "corpus.jsonl"
PLAN = """[run]
name = "{name}"
seed = 1
output_dir = "runs"

[model]
use = "scratch"
architecture = "llama"
hidden_size = 64
num_layers = 4
num_heads = 4
num_kv_heads = 2
intermediate_size = 256
max_position_embeddings = {length}
tokenizer_data = ["corpus"]
vocab_size = 512

[data.corpus]
use = "jsonl"
path = "{data}"

[[stage]]
name = "pretrain"
trainer = "pretrain"
data = "corpus"
adapter = "full"
max_steps = {steps}
batch_size = 1
max_length = {length}
logging_steps = 1
"""
SP2 = """
[distributed]
engine = "deepspeed"
nproc_per_node = 2
sp_size = 2
backend = "gloo"
master_port = {port}
"""


def plan_text(arm: str, length: int, steps: int, port: int) -> str:
    text = PLAN.format(name=f"{arm}-{length}", length=length, steps=steps, data=DATA.as_posix())
    return text + (SP2.format(port=port) if arm == "sp2" else "")


class PeakSampler:
    """The peak RSS (``VmHWM``) of every ``ftcore`` worker below ``root``, by its ``RANK``, sampled every 0.1 s:
    the last value a worker shows before it exits is its peak since it last reset it."""

    def __init__(self, root: int):
        self.root, self._stop = root, threading.Event()
        self.peaks: dict[int, tuple[int, int]] = {}  # pid -> (rank, VmHWM)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _descendants(self) -> list[int]:
        children: dict[int, list[int]] = {}
        for status in Path("/proc").glob("[0-9]*/status"):
            try:
                fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
                children.setdefault(int(fields["PPid"]), []).append(int(status.parent.name))
            except (OSError, KeyError, ValueError):
                continue
        out, todo = [], [self.root]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo += children.get(pid, [])
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            for pid in self._descendants():
                try:
                    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                    hwm = next(int(line.split()[1]) * 1024 for line in
                               Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("VmHWM"))
                except (OSError, StopIteration, ValueError):
                    continue
                rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
                if rank is not None and any(e.startswith(b"FTCORE_LAUNCH_DIR=") for e in env):  # a worker
                    self.peaks[pid] = (rank, hwm)  # the latest: the mark only grows until the worker resets it
                elif pid == self.root:
                    self.peaks[pid] = (-1, hwm)
            time.sleep(0.1)

    def stop(self) -> dict[int, float]:
        """Each rank's peak: the largest of its processes' (a helper a worker starts inherits its RANK)."""
        self._stop.set()
        self._thread.join()
        ranks: dict[int, int] = {}
        for rank, hwm in self.peaks.values():
            ranks[rank] = max(ranks.get(rank, 0), hwm)
        if len(ranks) > 1:
            ranks.pop(-1, None)  # workers: the launching process is not one of them
        return {max(rank, 0): round(b / MiB, 1) for rank, b in sorted(ranks.items())}


def run_one(folder: Path, arm: str, length: int, steps: int, port: int) -> dict:
    plan = folder / f"{arm}-{length}.toml"
    plan.write_text(plan_text(arm, length, steps, port), encoding="utf-8")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    estimate = subprocess.run([sys.executable, "-m", "ftcore", "estimate", str(plan), "--device", "cpu",
                               "--json"], capture_output=True, text=True, env=env, cwd=folder)
    if estimate.returncode != 0:
        raise SystemExit(f"ftcore estimate {plan.name} failed:\n{estimate.stderr[-3000:]}")
    stage = json.loads(estimate.stdout)["stages"][0]
    start = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "ftcore", "run", str(plan), "--force"], cwd=folder, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = PeakSampler(proc.pid)
    out, _ = proc.communicate()
    sampled = sampler.stop()
    if proc.returncode != 0:
        raise SystemExit(f"ftcore run {plan.name} failed ({proc.returncode}):\n{out[-3000:]}")
    memory = json.loads((folder / "runs" / f"{arm}-{length}" / "summary.json").read_text())["memory"]
    before = memory["pretrain: adapter applied"]["rss_mib"]
    peak = memory["pretrain: trained"]["peak_rss_mib"]
    return {"arm": arm, "length": length, "steps": steps, "rss_before_mib": before, "peak_rss_mib": peak,
            "delta_mib": round(peak - before, 1), "sampled_peak_mib": sampled,
            "estimate_activations_mib": round(stage["bytes"]["activations"] / MiB, 1),
            "estimate_axes": stage.get("axes", []), "seconds": round(time.time() - start, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--tiny", action="store_true", help="one length, 4096, 2 steps (the test's mode)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--jsonl", type=Path, help="append each run's result here as it finishes")
    p.add_argument("--keep", type=Path, help="run in this folder and keep it (default: a temporary one)")
    args = p.parse_args()
    if args.tiny:
        args.lengths, args.steps = [4096], 2
    folder = args.keep or Path(tempfile.mkdtemp(prefix="ftcore-sp-memory-"))
    folder.mkdir(parents=True, exist_ok=True)
    port = 29500 + os.getpid() % 2000
    runs: dict[tuple[str, int], dict] = {}
    for length in [CONTROL, *args.lengths]:
        for arm in ("sp1", "sp2"):
            r = run_one(folder, arm, length, args.steps, port)
            runs[arm, length] = r
            if args.jsonl:
                with args.jsonl.open("a", encoding="utf-8") as fh:
                    fh.write(json.dumps(r) + "\n")
    results = []
    for length in args.lengths:
        row = {"length": length}
        for arm in ("sp1", "sp2"):
            r, c = runs[arm, length], runs[arm, CONTROL]
            measured = round(r["delta_mib"] - c["delta_mib"], 1)
            estimated = round(r["estimate_activations_mib"] - c["estimate_activations_mib"], 1)
            row[arm] = {"measured_mib": measured, "estimate_mib": estimated,
                        "error_percent": round(100 * (estimated - measured) / measured, 1),
                        "delta_mib": r["delta_mib"], "control_delta_mib": c["delta_mib"],
                        "sampled_peak_mib": r["sampled_peak_mib"]}
        row["ratio"] = round(row["sp2"]["measured_mib"] / row["sp1"]["measured_mib"], 3)
        row["estimate_ratio"] = round(row["sp2"]["estimate_mib"] / row["sp1"]["estimate_mib"], 3)
        results.append(row)

    print(f"machine: {machine()}")
    print(f"runs: {args.steps} steps each, batch 1, control rows of {CONTROL} tokens; folder {folder}")
    print("| arm | row tokens | tokens a rank | peak - before (MiB) | control (MiB) | activations measured (MiB) | "
          "ftcore estimate (MiB) | estimate error |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in results:
        for arm, size in (("sp1", 1), ("sp2", 2)):
            a = row[arm]
            print(f"| {arm} | {row['length']:,} | {row['length'] // size:,} | {a['delta_mib']:.1f} | "
                  f"{a['control_delta_mib']:.1f} | {a['measured_mib']:.1f} | {a['estimate_mib']:.1f} | "
                  f"{a['error_percent']:+.1f}% |")
    for row in results:
        print(f"{row['length']:,} tokens: SP2/SP1 activation memory per rank {row['ratio']:.3f} measured, "
              f"{row['estimate_ratio']:.3f} estimated")
    for row in results:
        peaks = row["sp2"]["sampled_peak_mib"]
        if len(peaks) > 1:
            print(f"{row['length']:,} tokens, sp2: peak RSS from training to exit, sampled, by rank "
                  + ", ".join(f"rank {k} {v:,.1f} MiB" for k, v in peaks.items()))
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "steps": args.steps, "control": CONTROL,
                                         "results": results, "runs": list(runs.values())}, indent=2))


if __name__ == "__main__":
    main()
