"""Per-rank activation memory under sequence parallelism: one process against ``sp_size = 2``.

    python benchmarks/sequence_parallel_memory.py [--lengths 4096 8192] [--steps 4] [--tiny] [--json PATH]
                                                  [--jsonl PATH] [--keep DIR] [--device cpu|cuda] [--split-nodes]

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

``--split-nodes`` starts ``sp2`` as two single-process nodes of one machine (``nnodes = 2``, two ``ftcore run
--node-rank K``), each with ``LOCAL_RANK`` 0: the form that puts both ranks on one GPU.

``--device cuda`` measures on GPUs: the model has Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2
key/value heads, MLP 4864; architecture qwen2, the scratch vocabulary of 512 tokens, so the head is no part of
the activations), rows of 65,536 tokens (about 99 GB for one process, by the estimate), 3 steps. Memory is
CUDA's: ``"pretrain: trained"`` ``cuda_peak_allocated_mib`` minus ``"pretrain: adapter applied"``
``cuda_allocated_mib`` (0 while the model is still on the CPU), and every worker's ``nvidia-smi`` memory is
sampled beside it. With two GPUs or more ``sp2`` runs as torch launches it, over NCCL. With one (the ``device``
tool lends one) its two ranks share it as two nodes over gloo (NCCL takes one device a rank): gloo's CUDA
collectives stage through the host, so its step times say nothing of NCCL's, but what each rank holds is
Ulysses' own. The GPU machine lacks DeepSpeed; pack it beside the rest first::

    bash ../shared/gpu/pack.sh && bash benchmarks/pack_deepspeed.sh
    # device command, carry [".device"]:
    source .device/setup.sh && python3 benchmarks/sequence_parallel_memory.py --device cuda --jsonl $OUT/sp.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
# The model's shape: the CPU's is tiny, so that what a step adds is its activations; the GPU's is Qwen2.5-0.5B's.
SHAPES = {"cpu": dict(architecture="llama", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                      intermediate_size=256),
          "cuda": dict(architecture="qwen2", hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                       intermediate_size=4864)}
DATA = ROOT / "examples" / "quickstart" / "data" / "corpus.jsonl"
PLAN = """[run]
name = "{name}"
seed = 1
output_dir = "runs"

[model]
use = "scratch"
architecture = "{architecture}"
hidden_size = {hidden_size}
num_layers = {num_layers}
num_heads = {num_heads}
num_kv_heads = {num_kv_heads}
intermediate_size = {intermediate_size}
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
{processes}
sp_size = 2
backend = "{backend}"
master_port = {port}
"""


def plan_text(arm: str, length: int, steps: int, port: int, device: str = "cpu", split: bool = False) -> str:
    """The plan of one run: ``split`` puts sp2's ranks in two single-process nodes (both on ``LOCAL_RANK`` 0)."""
    text = PLAN.format(name=f"{arm}-{length}", length=length, steps=steps, data=DATA.as_posix(), **SHAPES[device])
    if arm == "sp1":
        return text
    return text + SP2.format(processes="nproc_per_node = 1\nnnodes = 2" if split else "nproc_per_node = 2",
                             backend="gloo" if split or device == "cpu" else "auto", port=port)


class PeakSampler:
    """The peak RSS (``VmHWM``) of every ``ftcore`` worker below the ``roots``, by its ``RANK``, sampled every 0.1 s:
    the last value a worker shows before it exits is its peak since it last reset it. With ``gpu``, also the
    largest GPU memory ``nvidia-smi`` shows for each worker (what its allocator reserved, and CUDA's context)."""

    def __init__(self, roots: list[int], gpu: bool = False):
        self.roots, self.gpu, self._stop = roots, gpu, threading.Event()
        self.peaks: dict[int, tuple[int, int]] = {}  # pid -> (rank, VmHWM)
        self.gpu_peaks: dict[int, int] = {}  # rank -> MiB
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
        out, todo = [], list(self.roots)
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo += children.get(pid, [])
        return out

    def _gpu_used(self) -> dict[int, int]:
        """MiB of GPU memory by process id, as ``nvidia-smi`` lists the compute processes."""
        try:
            query = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
            out = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout
            return {int(pid): int(used) for pid, used in (line.split(",") for line in out.splitlines() if "," in line)}
        except (OSError, ValueError, subprocess.TimeoutExpired):
            return {}

    def _run(self) -> None:
        while not self._stop.is_set():
            used = self._gpu_used() if self.gpu else {}
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
                elif pid in self.roots:
                    self.peaks[pid] = (-1, hwm)
                if pid in used:
                    key = -1 if rank is None else rank
                    self.gpu_peaks[key] = max(self.gpu_peaks.get(key, 0), used[pid])
            time.sleep(0.1)

    def stop(self) -> tuple[dict[int, float], dict[int, int]]:
        """Each rank's peak RSS, the largest of its processes' (a helper a worker starts inherits its RANK), and
        each rank's peak GPU memory."""
        self._stop.set()
        self._thread.join()
        ranks: dict[int, int] = {}
        for rank, hwm in self.peaks.values():
            ranks[rank] = max(ranks.get(rank, 0), hwm)
        if len(ranks) > 1:
            ranks.pop(-1, None)  # workers: the launching process is not one of them
        return ({max(rank, 0): round(b / MiB, 1) for rank, b in sorted(ranks.items())},
                {max(rank, 0): mib for rank, mib in sorted(self.gpu_peaks.items())})


def run_one(folder: Path, arm: str, length: int, args: argparse.Namespace, port: int) -> dict:
    """One ``ftcore run`` of the arm (sp2 with ``--split-nodes``: two, one a node) and its estimate."""
    plan = folder / f"{arm}-{length}.toml"
    split = args.split_nodes and arm == "sp2"
    plan.write_text(plan_text(arm, length, args.steps, port, args.device, split), encoding="utf-8")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    estimate = subprocess.run([sys.executable, "-m", "ftcore", "estimate", str(plan), "--device", args.device,
                               "--json"], capture_output=True, text=True, env=env, cwd=folder)
    if estimate.returncode != 0:
        return {"arm": arm, "length": length, "error": f"ftcore estimate failed: {estimate.stderr[-2000:]}"}
    stage = json.loads(estimate.stdout)["stages"][0]
    start = time.time()
    command = [sys.executable, "-m", "ftcore", "run", str(plan), "--force"]
    procs = [subprocess.Popen([*command, "--node-rank", str(node)] if split else command, cwd=folder, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for node in ((1, 0) if split else (0,))]
    sampler = PeakSampler([p.pid for p in procs], gpu=args.device == "cuda")
    outs = [p.communicate()[0] for p in procs]
    sampled, sampled_gpu = sampler.stop()
    failed = [(p.returncode, out) for p, out in zip(procs, outs) if p.returncode != 0]
    if failed:
        return {"arm": arm, "length": length, "error": f"ftcore run failed ({failed[0][0]}): {failed[0][1][-3000:]}"}
    memory = json.loads((folder / "runs" / f"{arm}-{length}" / "summary.json").read_text())["memory"]
    before, after = memory["pretrain: adapter applied"], memory["pretrain: trained"]
    if args.device == "cuda":  # no CUDA figure before training: the model was still on the CPU
        before, peak = before.get("cuda_allocated_mib", 0.0), after["cuda_peak_allocated_mib"]
    else:
        before, peak = before["rss_mib"], after["peak_rss_mib"]
    return {"arm": arm, "length": length, "steps": args.steps, "device": args.device, "split_nodes": split,
            "before_mib": before, "peak_mib": peak, "delta_mib": round(peak - before, 1),
            "sampled_peak_mib": sampled, "sampled_gpu_mib": sampled_gpu,
            "estimate_activations_mib": round(stage["bytes"]["activations"] / MiB, 1),
            "estimate_axes": stage.get("axes", []), "seconds": round(time.time() - start, 1)}


def gpu_count() -> int:
    """GPUs this process may use, from ``nvidia-smi`` and ``CUDA_VISIBLE_DEVICES`` (torch stays unimported here)."""
    try:
        listed = [line for line in subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                                  timeout=30).stdout.splitlines() if line.startswith("GPU ")]
    except (OSError, subprocess.TimeoutExpired):
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return len(listed) if visible is None else min(len(listed), len([v for v in visible.split(",") if v.strip()]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", help="row lengths (default: 4096 8192 on a CPU, 65536 on GPUs)")
    p.add_argument("--steps", type=int, help="steps a run (default: 4 on a CPU, 3 on GPUs)")
    p.add_argument("--tiny", action="store_true", help="one length, 4096, 2 steps (the test's mode)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--split-nodes", action="store_true",
                   help="sp2 as two single-process nodes, each on LOCAL_RANK 0 (chosen on one GPU)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--jsonl", type=Path, help="append each run's result here as it finishes")
    p.add_argument("--keep", type=Path, help="run in this folder and keep it (default: a temporary one)")
    args = p.parse_args()
    gpu = args.device == "cuda"
    args.lengths = args.lengths or ([65536] if gpu else [4096, 8192])
    args.steps = args.steps or (3 if gpu else 4)
    if args.tiny:
        args.lengths, args.steps = [4096], 2
    if gpu:
        gpus = gpu_count()
        if gpus == 0:
            raise SystemExit("--device cuda: nvidia-smi lists no GPU")
        args.split_nodes = args.split_nodes or gpus == 1
    folder = args.keep or Path(tempfile.mkdtemp(prefix="ftcore-sp-memory-"))
    folder.mkdir(parents=True, exist_ok=True)
    port = 29500 + os.getpid() % 2000
    print(f"machine: {machine()}", flush=True)
    runs: dict[tuple[str, int], dict] = {}
    for length in [CONTROL, *args.lengths]:
        for arm in ("sp1", "sp2"):
            r = runs[arm, length] = run_one(folder, arm, length, args, port)
            print(f"{arm} {length:,}: " + (f"failed: {r['error'].strip().splitlines()[-1:]}" if "error" in r else
                                           f"peak - before {r['delta_mib']:,.1f} MiB, {r['seconds']} s"), flush=True)
            if args.jsonl:
                with args.jsonl.open("a", encoding="utf-8") as fh:
                    fh.write(json.dumps(r) + "\n")
    results = []
    for length in args.lengths:
        row = {"length": length}
        for arm in ("sp1", "sp2"):
            r, c = runs[arm, length], runs[arm, CONTROL]
            if "error" in r or "error" in c:
                continue
            measured = round(r["delta_mib"] - c["delta_mib"], 1)
            estimated = round(r["estimate_activations_mib"] - c["estimate_activations_mib"], 1)
            row[arm] = {"measured_mib": measured, "estimate_mib": estimated,
                        "error_percent": round(100 * (estimated - measured) / measured, 1),
                        "delta_mib": r["delta_mib"], "control_delta_mib": c["delta_mib"],
                        "sampled_peak_mib": r["sampled_peak_mib"], "sampled_gpu_mib": r["sampled_gpu_mib"]}
        if "sp1" in row and "sp2" in row:
            row["ratio"] = round(row["sp2"]["measured_mib"] / row["sp1"]["measured_mib"], 3)
            row["estimate_ratio"] = round(row["sp2"]["estimate_mib"] / row["sp1"]["estimate_mib"], 3)
        results.append(row)

    memory = "CUDA peak allocated" if gpu else "peak RSS"
    print(f"runs: {args.steps} steps each, batch 1, control rows of {CONTROL} tokens, {memory}"
          + (", sp2 as two single-process nodes" if args.split_nodes else "")
          + (f"; kept in {folder}" if args.keep else ""))
    print("| arm | row tokens | tokens a rank | peak - before (MiB) | control (MiB) | activations measured (MiB) | "
          "ftcore estimate (MiB) | estimate error |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in results:
        for arm, size in (("sp1", 1), ("sp2", 2)):
            a = row.get(arm)
            if a is None:
                print(f"| {arm} | {row['length']:,} | {row['length'] // size:,} | failed | | | | |")
                continue
            print(f"| {arm} | {row['length']:,} | {row['length'] // size:,} | {a['delta_mib']:.1f} | "
                  f"{a['control_delta_mib']:.1f} | {a['measured_mib']:.1f} | {a['estimate_mib']:.1f} | "
                  f"{a['error_percent']:+.1f}% |")
    for row in results:
        if "ratio" in row:
            print(f"{row['length']:,} tokens: SP2/SP1 activation memory per rank {row['ratio']:.3f} measured, "
                  f"{row['estimate_ratio']:.3f} estimated")
    for row in results:
        for key, what in (("sampled_peak_mib", "peak RSS"), ("sampled_gpu_mib", "nvidia-smi memory")):
            peaks = row.get("sp2", {}).get(key, {})
            if len(peaks) > 1:
                print(f"{row['length']:,} tokens, sp2: {what} from training to exit, sampled, by rank "
                      + ", ".join(f"rank {k} {v:,.1f} MiB" for k, v in peaks.items()))
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "device": args.device, "steps": args.steps,
                                         "control": CONTROL, "split_nodes": args.split_nodes, "results": results,
                                         "runs": list(runs.values())}, indent=2))
    if not args.keep:
        shutil.rmtree(folder, ignore_errors=True)
    if any("error" in r for r in runs.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
