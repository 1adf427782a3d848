"""Tokenized-data preparation at corpus sizes: peak memory, time, throughput and resuming.

    python benchmarks/prepare_scale.py [--sizes 250000 500000 1000000 2000000] [--tiny]

The rows are C4-like text: each a window of 2-8 consecutive sentences of a document of the real
C4 sample in ../shared/fixtures/data/c4_demo.jsonl, and one sentence of another (generated
sentences when it is absent), so nearly every row is new. Each size is a JSONL file of that many
rows, and each measurement runs in a process of its own, so its peak is its own:

* prepare: the ``ftcore prepare`` command, in the measuring process, on a plan whose ``jsonl``
  source reads the file (``format = "text"``) for a ``pretrain`` stage (Qwen2.5's tokenizer, EOS
  added), into an empty cache: reading, validation, conversion, the quality filters and duplicate
  count, the content hash, tokenization into shards. The whole process's peak RSS (VmHWM, what
  ``/usr/bin/time`` reports), and its peak above its RSS before the command (the libraries already
  imported); the command's time, and the time of its tokenization (``encode_shards``).
* raw: the same rows through the same Rust tokenizer, batched the same way (1,000 rows per
  ``encode_batch``), the token ids thrown away: the throughput bound. Ratio tokenization/raw in
  tokens/s.
* resume: a preparation of the largest size killed (SIGKILL) once half its shards are finished,
  then run again: its time against an uninterrupted preparation.

``--tiny`` (the test's mode): one size, 4,000 rows, with 500-row shards.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from _bench import SHARED, machine  # noqa: E402

C4 = SHARED / "data" / "c4_demo.jsonl"
QWEN = SHARED / "tokenizers" / "qwen25"


def sentences() -> list[list[str]]:
    """The documents of the C4 sample split into sentences, or generated ones without it."""
    if C4.exists():
        docs = [json.loads(line)["text"] for line in C4.read_text(encoding="utf-8").splitlines() if line.strip()]
        return [s for s in (re.split(r"(?<=[.!?])\s+", d) for d in docs) if len(s) >= 2]
    rng = random.Random(0)
    words = "the a model data river city water light early small open first because under".split()
    return [[" ".join(rng.choices(words, k=rng.randint(6, 24))).capitalize() + "." for _ in range(20)]
            for _ in range(300)]


def write_corpus(path: Path, rows: int, seed: int = 0, vary: bool = True) -> int:
    """``rows`` C4-like rows to ``path``; returns the bytes written. Each row is a window of one
    document, and with ``vary`` one sentence of another, so that rows rarely repeat (the sample has
    300 documents: windows alone repeat, 98% of 2M rows)."""
    rng, docs = random.Random(seed), sentences()
    with open(path, "w", encoding="utf-8") as out:
        for _ in range(rows):
            doc = rng.choice(docs)
            start = rng.randrange(len(doc) - 1)
            window = doc[start:start + rng.randint(2, 8)]
            if vary:
                window = [*window, rng.choice(rng.choice(docs))]
            out.write(json.dumps({"text": " ".join(window)}) + "\n")
    return path.stat().st_size


def tokenizer():
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if QWEN.exists():
        return AutoTokenizer.from_pretrained(QWEN)
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator((" ".join(d) for d in sentences()), trainers.BpeTrainer(
        vocab_size=4096, special_tokens=["<unk>", "<eos>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")


PLAN = """
[run]
name = "prepare-scale"
output_dir = "runs"

[model]
use = "scratch"
hidden_size = 64
num_layers = 2
num_heads = 4
intermediate_size = 128
tokenizer = "{tokenizer}"

[data.corpus]
use = "jsonl"
path = "{corpus}"
format = "text"

[[stage]]
name = "pretrain"
trainer = "pretrain"
data = "corpus"
max_steps = 1
"""


def arm(kind: str, corpus: Path, shard_rows: int) -> dict:
    """One measurement in this process (``--arm``): prepare or raw over ``corpus``."""
    import datasets

    from ftcore import memory

    reused = len(list((Path(os.environ["FTCORE_CACHE_DIR"]) / "tokenized").glob("*/.*.partial/[0-9]*.json")))
    if kind == "prepare":
        import ftcore_plugins.common.prepare as prepare_module
        from ftcore.cli import main as ftcore_main

        prepare_module.SHARD_ROWS = shard_rows
        encoded, encode_shards = {}, prepare_module.encode_shards

        def timed(*args, **kwargs):  # the tokenization, timed where the command calls it
            start = time.perf_counter()
            stats = encode_shards(*args, **kwargs)
            encoded.update(stats, seconds=time.perf_counter() - start)
            return stats

        prepare_module.encode_shards = timed
        plan = corpus.with_suffix(".toml")
        plan.write_text(PLAN.format(tokenizer=os.environ["PREPARE_SCALE_TOKENIZER"], corpus=corpus))
        before = memory.snapshot()["rss_mib"]  # the libraries imported, nothing read
        start = time.perf_counter()
        try:
            ftcore_main(["prepare", str(plan)])
        except SystemExit as exc:
            if exc.code:
                raise
        seconds = time.perf_counter() - start
        peak = memory.snapshot()["peak_rss_mib"]
        return {"kind": kind, "rows": encoded["rows"], "samples": encoded["kept"], "tokens": encoded["tokens"],
                "seconds": seconds, "tokenize_seconds": encoded["seconds"], "rss_before_mib": before,
                "peak_rss_mib": peak, "peak_above_mib": peak - before, "shards_reused": reused}
    rows = datasets.load_dataset("json", data_files=[str(corpus)], split="train")
    tok = tokenizer()
    backend = tok.backend_tokenizer
    backend.no_padding()
    backend.no_truncation()
    tokens = samples = 0
    start = time.perf_counter()
    for batch in rows.iter(batch_size=1000):
        encoded = backend.encode_batch([t + tok.eos_token for t in batch["text"]], add_special_tokens=False)
        tokens += sum(len(e.ids) for e in encoded)
        samples += len(encoded)
    return {"kind": kind, "rows": len(rows), "samples": samples, "tokens": tokens,
            "seconds": time.perf_counter() - start}


def arm_env(cache: Path) -> dict:
    """ftcore's cache and datasets' (the JSON read as Arrow) in the benchmark's scratch folder; the
    tokenizer folder the plan names."""
    return {**os.environ, "FTCORE_CACHE_DIR": str(cache), "HF_DATASETS_CACHE": str(cache / "hf-datasets"),
            "PREPARE_SCALE_TOKENIZER": str(cache.parent / "tokenizer")}


def run_arm(kind: str, corpus: Path, cache: Path, shard_rows: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--arm", kind, str(corpus), "--shard-rows", str(shard_rows)],
                         capture_output=True, text=True, env=arm_env(cache))
    if out.returncode:
        sys.exit(f"{kind} arm on {corpus.name} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def killed_and_resumed(corpus: Path, cache: Path, shard_rows: int, rows: int) -> dict:
    """Prepare ``corpus`` until half its shards are finished, SIGKILL it, prepare it again."""
    shards = -(-rows // shard_rows)
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, "--arm", "prepare", str(corpus), "--shard-rows",
                             str(shard_rows)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=arm_env(cache))
    finished = 0
    while proc.poll() is None:
        finished = len(list((cache / "tokenized").glob("*/.*.partial/[0-9]*.json")))
        if finished >= shards // 2:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.05)
    proc.wait()
    killed_after = time.perf_counter() - started
    if finished < shards // 2:
        sys.exit("the preparation ended before half its shards were finished: nothing to resume")
    resumed = run_arm("prepare", corpus, cache, shard_rows)
    return {"shards": shards, "finished_when_killed": finished, "killed_after_s": killed_after,
            "resumed_s": resumed["seconds"], "resumed_tokenize_s": resumed["tokenize_seconds"],
            "tokens": resumed["tokens"], "shards_reused": resumed["shards_reused"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[250_000, 500_000, 1_000_000, 2_000_000])
    p.add_argument("--shard-rows", type=int, default=50_000)
    p.add_argument("--tiny", action="store_true", help="4,000 rows, 500-row shards (the test's mode)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--arm", nargs=2, metavar=("KIND", "CORPUS"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.arm:
        print(json.dumps(arm(a.arm[0], Path(a.arm[1]), a.shard_rows)))
        return
    sizes, shard_rows = ([4_000], 500) if a.tiny else (sorted(a.sizes), a.shard_rows)
    results = []
    with tempfile.TemporaryDirectory(prefix="ftcore-prepare-scale-") as work:
        work = Path(work)
        tokenizer().save_pretrained(work / "tokenizer")
        for size in sizes:
            corpus = work / f"rows-{size}.jsonl"
            size_bytes = write_corpus(corpus, size)
            prepared = run_arm("prepare", corpus, work / f"cache-{size}", shard_rows)
            raw = run_arm("raw", corpus, work / f"cache-{size}", shard_rows)
            # the same rows, but those the source's default filters drop (a few non-text ones)
            assert 0.99 * raw["rows"] <= prepared["rows"] <= raw["rows"], (prepared["rows"], raw["rows"])
            results.append({"rows": size, "bytes": size_bytes, "prepare": prepared, "raw": raw})
        largest = work / f"rows-{sizes[-1]}.jsonl"
        resume = killed_and_resumed(largest, work / "cache-resume", shard_rows, sizes[-1])
    first = results[0]
    print(f"machine: {machine()}")
    print(f"tokenizer: {'Qwen2.5 (' + str(QWEN) + ')' if QWEN.exists() else 'a BPE trained here'}; rows: "
          f"{'windows of ' + C4.name + ' and a sentence of another document' if C4.exists() else 'generated sentences'}"
          f"; shards of {shard_rows:,} rows")
    print()
    print("| rows | corpus MiB | tokens | `ftcore prepare` s | time / rows vs first | peak RSS, whole process (MiB) | "
          "vs first | peak above the RSS before the command (MiB) | vs first | tokenization s | "
          "tokenization tokens/s | raw tokens/s | ratio tokenization/raw |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        pr, raw, pf = r["prepare"], r["raw"], first["prepare"]
        per_row = (pr["seconds"] / r["rows"]) / (pf["seconds"] / first["rows"])
        rate, raw_rate = pr["tokens"] / pr["tokenize_seconds"], raw["tokens"] / raw["seconds"]
        print(f"| {r['rows']:,} | {r['bytes'] / 2**20:.0f} | {pr['tokens']:,} | {pr['seconds']:.1f} | {per_row:.2f} | "
              f"{pr['peak_rss_mib']:.0f} | {pr['peak_rss_mib'] / pf['peak_rss_mib']:.2f} | "
              f"{pr['peak_above_mib']:.0f} | {pr['peak_above_mib'] / pf['peak_above_mib']:.2f} | "
              f"{pr['tokenize_seconds']:.1f} | {rate:,.0f} | {raw_rate:,.0f} | {rate / raw_rate:.2f} |")
    full = next(r for r in results if r["rows"] == sizes[-1])["prepare"]
    print()
    print(f"killed (SIGKILL) with {resume['finished_when_killed']} of {resume['shards']} shards finished, after "
          f"{resume['killed_after_s']:.1f} s; the rerun reused {resume['shards_reused']} and took "
          f"{resume['resumed_s']:.1f} s against {full['seconds']:.1f} s uninterrupted "
          f"({full['seconds'] - resume['resumed_s']:.1f} s saved; its tokenization "
          f"{resume['resumed_tokenize_s']:.1f} s against {full['tokenize_seconds']:.1f} s: "
          f"{full['tokenize_seconds'] - resume['resumed_tokenize_s']:.1f} s saved)")
    if a.json:
        a.json.write_text(json.dumps({"results": results, "resume": resume, "uninterrupted_s": full["seconds"]},
                                     indent=1))


if __name__ == "__main__":
    main()
