"""Tokenized-data preparation at corpus sizes: peak memory, time, throughput and resuming.

    python benchmarks/prepare_scale.py [--sizes 250000 500000 1000000 2000000] [--tiny]

The rows are C4-like text: each a window of 2-8 consecutive sentences of a document of the real
C4 sample in ../shared/fixtures/data/c4_demo.jsonl (generated sentences when it is absent), so the
corpus varies row to row. Each size is a JSONL file of that many rows, and each measurement runs
in a process of its own, so its peak is its own:

* prepare: ``datasets.load_dataset("json")`` (as ftcore's ``jsonl`` source reads a file: Arrow,
  memory-mapped), then ``prepare()`` as ``pretrain`` calls it (Qwen2.5's tokenizer, text rows,
  EOS added, no max_length), into an empty cache. Peak RSS (VmHWM) above the RSS before
  ``prepare()``, which also counts the input's memory-mapped pages the pass touches (page cache),
  and the peak of the anonymous memory (RssAnon, sampled every 20 ms): the process's own heap,
  which is what must not grow with the corpus. And the whole process's peak above its RSS before
  the corpus is read, reading it included (the input's pages handed back once read, as ftcore's
  sources do). And its time.
* raw: the same rows through the same Rust tokenizer, batched the same way (1,000 rows per
  ``encode_batch``), the token ids thrown away: the throughput bound. Ratio prepare/raw in tokens/s.
* resume: a preparation of the largest size killed (SIGKILL) once half its shards are finished,
  then run again: its time against an uninterrupted preparation.

``--tiny`` (the test's mode): sizes 2,000 and 4,000 rows with 500-row shards.
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
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from _bench import SHARED, machine, rss_anon  # noqa: E402

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


def write_corpus(path: Path, rows: int, seed: int = 0) -> int:
    """``rows`` C4-like rows to ``path``; returns the bytes written."""
    rng, docs = random.Random(seed), sentences()
    with open(path, "w", encoding="utf-8") as out:
        for _ in range(rows):
            doc = rng.choice(docs)
            start = rng.randrange(len(doc) - 1)
            out.write(json.dumps({"text": " ".join(doc[start:start + rng.randint(2, 8)])}) + "\n")
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


def arm(kind: str, corpus: Path, shard_rows: int) -> dict:
    """One measurement in this process (``--arm``): prepare or raw over ``corpus``."""
    import datasets

    from ftcore import memory

    from ftcore_plugins.common.prepare import release_input

    rss_start = memory.snapshot()["rss_mib"]  # before the corpus is read
    rows = datasets.load_dataset("json", data_files=[str(corpus)], split="train")
    release_input(rows)  # as ftcore's sources do once they have read their files
    tok = tokenizer()
    load_peak = memory.snapshot()["peak_rss_mib"]
    # shards a killed preparation finished: the rerun must not encode them again
    reused = len(list((Path(os.environ["FTCORE_CACHE_DIR"]) / "tokenized").glob("*/.*.partial/[0-9]*.json")))
    before = memory.snapshot()["rss_mib"]
    memory.reset_peak()
    # VmHWM also counts the pages of the memory-mapped input the pass touches (the page cache's):
    # the anonymous memory (the process's own heap), sampled, is what must stay flat.
    anon_before, anon_peak, done = rss_anon(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            anon_peak[0] = max(anon_peak[0], rss_anon())
            done.wait(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    if kind == "prepare":
        import ftcore_plugins.common.prepare as prepare_module
        from ftcore_plugins.templates.chatml import ChatMLTemplate

        prepare_module.SHARD_ROWS = shard_rows
        prepared = prepare_module.prepare(rows, tok, ChatMLTemplate(), max_length=None, description="prepare")
        tokens, samples = prepared.stats["tokens"], prepared.stats["kept"]
    else:
        backend = tok.backend_tokenizer
        backend.no_padding()
        backend.no_truncation()
        tokens = samples = 0
        for batch in rows.iter(batch_size=1000):
            encoded = backend.encode_batch([t + tok.eos_token for t in batch["text"]], add_special_tokens=False)
            tokens += sum(len(e.ids) for e in encoded)
            samples += len(encoded)
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    after = memory.snapshot()
    return {"kind": kind, "rows": len(rows), "samples": samples, "tokens": tokens, "seconds": seconds,
            "rss_before_mib": before, "peak_above_mib": after["peak_rss_mib"] - before, "shards_reused": reused,
            "process_peak_above_mib": max(load_peak, after["peak_rss_mib"]) - rss_start,
            "anon_peak_above_mib": (max(anon_peak[0], rss_anon()) - anon_before) / 2**20}


def arm_env(cache: Path) -> dict:
    """ftcore's cache and datasets' (the JSON read as Arrow) in the benchmark's scratch folder."""
    return {**os.environ, "FTCORE_CACHE_DIR": str(cache), "HF_DATASETS_CACHE": str(cache.parent / "hf-datasets")}


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
            "resumed_s": resumed["seconds"], "tokens": resumed["tokens"], "shards_reused": resumed["shards_reused"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[250_000, 500_000, 1_000_000, 2_000_000])
    p.add_argument("--shard-rows", type=int, default=50_000)
    p.add_argument("--tiny", action="store_true", help="2,000 and 4,000 rows, 500-row shards (the test's mode)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--arm", nargs=2, metavar=("KIND", "CORPUS"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.arm:
        print(json.dumps(arm(a.arm[0], Path(a.arm[1]), a.shard_rows)))
        return
    sizes, shard_rows = ([2_000, 4_000], 500) if a.tiny else (sorted(a.sizes), a.shard_rows)
    results = []
    with tempfile.TemporaryDirectory(prefix="ftcore-prepare-scale-") as work:
        work = Path(work)
        for size in sizes:
            corpus = work / f"rows-{size}.jsonl"
            size_bytes = write_corpus(corpus, size)
            prepared = run_arm("prepare", corpus, work / f"cache-{size}", shard_rows)
            raw = run_arm("raw", corpus, work / f"cache-{size}", shard_rows)
            assert prepared["tokens"] == raw["tokens"], (prepared["tokens"], raw["tokens"])  # the same work
            results.append({"rows": size, "bytes": size_bytes, "prepare": prepared, "raw": raw})
        largest = work / f"rows-{sizes[-1]}.jsonl"
        resume = killed_and_resumed(largest, work / "cache-resume", shard_rows, sizes[-1])
    first = results[0]
    print(f"machine: {machine()}")
    print(f"tokenizer: {'Qwen2.5 (' + str(QWEN) + ')' if QWEN.exists() else 'a BPE trained here'}; rows: "
          f"{'windows of ' + C4.name if C4.exists() else 'generated sentences'}; shards of {shard_rows:,} rows")
    print()
    print("| rows | corpus MiB | tokens | prepare s | peak RSS above start (MiB) | time / rows vs first | "
          "peak vs first | prepare tokens/s | raw tokens/s | ratio prepare/raw | anonymous peak above start (MiB) | "
          "anonymous peak vs first | whole process: peak above start, reading the corpus included (MiB) | "
          "whole process vs first |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        pr, raw = r["prepare"], r["raw"]
        per_row = (pr["seconds"] / r["rows"]) / (first["prepare"]["seconds"] / first["rows"])
        peak = pr["peak_above_mib"] / first["prepare"]["peak_above_mib"]
        rate, raw_rate = pr["tokens"] / pr["seconds"], raw["tokens"] / raw["seconds"]
        print(f"| {r['rows']:,} | {r['bytes'] / 2**20:.0f} | {pr['tokens']:,} | {pr['seconds']:.1f} | "
              f"{pr['peak_above_mib']:.0f} | {per_row:.2f} | {peak:.2f} | {rate:,.0f} | {raw_rate:,.0f} | "
              f"{rate / raw_rate:.2f} | {pr['anon_peak_above_mib']:.0f} | "
              f"{pr['anon_peak_above_mib'] / first['prepare']['anon_peak_above_mib']:.2f} | "
              f"{pr['process_peak_above_mib']:.0f} | "
              f"{pr['process_peak_above_mib'] / first['prepare']['process_peak_above_mib']:.2f} |")
    full = next(r for r in results if r["rows"] == sizes[-1])["prepare"]["seconds"]
    print()
    print(f"killed (SIGKILL) with {resume['finished_when_killed']} of {resume['shards']} shards finished, after "
          f"{resume['killed_after_s']:.1f} s; the rerun reused {resume['shards_reused']} and took "
          f"{resume['resumed_s']:.1f} s against {full:.1f} s "
          f"uninterrupted: {full - resume['resumed_s']:.1f} s saved")
    if a.json:
        a.json.write_text(json.dumps({"results": results, "resume": resume, "uninterrupted_s": full}, indent=1))


if __name__ == "__main__":
    main()
