"""A streaming pretrain run over a corpus of millions of rows: time to the first step, and RSS over the run.

    python benchmarks/streaming.py [--rows 2000000] [--steps 50] [--tiny]

The corpus is C4-like rows (windows of the real C4 sample, as benchmarks/prepare_scale.py makes
them) in one JSONL file. The plan pretrains a small Llama (hidden 64, 2 layers) with the real
Qwen2.5 tokenizer on it with ``streaming = true``, wrapped blocks of 256 tokens, batch 4, for
``--steps`` steps, logging every step. ``ftcore run`` runs in a process of its own while this one
samples its RSS (VmRSS) every 0.2 s. It reports:

* the seconds from the source's load (its log line in run.log) to the first training step (the
  first step's record in metrics.jsonl, minus that step's own duration), and from the process's start;
* RSS at the first step, at the middle and at the last, and its growth over the steps;
* the tokens the run trained (steps x batch x 256: every block is full).

``--tiny`` (the test's mode): 20,000 rows, 5 steps.
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
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from _bench import machine  # noqa: E402
from prepare_scale import QWEN, write_corpus  # noqa: E402

PLAN = """
[run]
name = "stream"
seed = 1

[model]
use = "scratch"
hidden_size = 64
num_layers = 2
num_heads = 4
max_position_embeddings = 256
tokenizer = "{tokenizer}"

[data.corpus]
use = "jsonl"
path = "{corpus}"
streaming = true

[[stage]]
name = "pretrain"
trainer = "pretrain"
data = "corpus"
max_length = 256
max_steps = {steps}
batch_size = 4
logging_steps = 1
save_steps = 100000
"""


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--tiny", action="store_true", help="20,000 rows, 5 steps (the test's mode)")
    p.add_argument("--json", type=Path, help="also write the results here")
    a = p.parse_args()
    if not QWEN.exists():
        sys.exit(f"needs the real Qwen2.5 tokenizer in {QWEN}")
    rows, steps = (20_000, 5) if a.tiny else (a.rows, a.steps)
    with tempfile.TemporaryDirectory(prefix="ftcore-streaming-") as work:
        work = Path(work)
        corpus = work / "corpus.jsonl"
        size = write_corpus(corpus, rows, vary=False)  # the corpus its RESULTS were measured on
        plan = work / "plan.toml"
        plan.write_text(PLAN.format(tokenizer=QWEN, corpus=corpus, steps=steps))
        samples: list[tuple[float, float]] = []
        started = time.time()
        proc = subprocess.Popen([sys.executable, "-m", "ftcore", "run", str(plan)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore",
                                                                        "FTCORE_CACHE_DIR": str(work / "cache")})

        def sample() -> None:
            while proc.poll() is None:
                value = rss_mib(proc.pid)
                if value is not None:
                    samples.append((time.time(), value))
                time.sleep(0.2)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, err = proc.communicate()
        sampler.join()
        if proc.returncode:
            sys.exit(f"the run failed:\n{err[-3000:]}")
        run = work / "runs" / "stream"
        log = (run / "run.log").read_text()
        line = next(x for x in log.splitlines() if "data corpus: streaming" in x)
        loaded = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        stepped = [r for r in records if r.get("stage") == "pretrain" and "loss" in r and r.get("step")]
        summary = json.loads((run / "summary.json").read_text())
    step_times = [b["time"] - a_["time"] for a_, b in zip(stepped, stepped[1:])]
    typical = sorted(step_times)[len(step_times) // 2] if step_times else 0.0
    first_step = stepped[0]["time"] - typical  # when the first step began, near enough
    at = {r["step"]: r["time"] for r in stepped}

    def rss_at(t: float) -> float:
        return min(samples, key=lambda s: abs(s[0] - t))[1]

    middle = stepped[len(stepped) // 2]["step"]
    rss = {"first": rss_at(at[stepped[0]["step"]]), "middle": rss_at(at[middle]), "last": rss_at(at[stepped[-1]["step"]])}
    result = {"rows": rows, "corpus_mib": size / 2**20, "steps": len(stepped),
              "load_to_first_step_s": first_step - loaded, "start_to_first_step_s": first_step - started,
              "step_s": typical, "rss_mib": rss, "peak_rss_mib": max(v for _, v in samples),
              "train_tokens": summary["stages"]["pretrain"].get("train_tokens")}
    print(f"machine: {machine()}")
    print(f"corpus: {rows:,} rows, {result['corpus_mib']:,.0f} MiB of JSONL; {len(stepped)} steps of 4 x 256 tokens "
          f"({result['train_tokens']:,} tokens trained)")
    print(f"from the source's load to the first step: {result['load_to_first_step_s']:.1f} s "
          f"(from the process's start: {result['start_to_first_step_s']:.1f} s); median step {typical:.2f} s")
    print(f"RSS at the first step {rss['first']:,.0f} MiB, the middle {rss['middle']:,.0f} MiB, the last "
          f"{rss['last']:,.0f} MiB: {rss['last'] - rss['first']:+,.0f} MiB over the run "
          f"({(rss['last'] / rss['first'] - 1):+.1%}); peak {result['peak_rss_mib']:,.0f} MiB")
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
