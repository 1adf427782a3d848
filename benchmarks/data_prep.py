"""Data preparation speed, side by side in one run.

    python benchmarks/data_prep.py [--repeat 3] [--copies 5]

1. Throughput: rows/s from chat rows to masked, tokenized samples (ftcore's `encode`:
   render, tokenize, label assistant spans), against a raw batched `tokenizer(texts)` on
   the same rendered texts. The issue's bar is a ratio of at least 0.9.
2. Cache: a second identical `prepare` (cache hit) against the first (cold), as a share.

Uses the real Alpaca rows and Qwen2.5 tokenizer from ../shared/fixtures when present,
otherwise generated rows and a tokenizer trained here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "fixtures"


def load_rows_and_tokenizer(copies: int):
    from transformers import AutoTokenizer

    alpaca = SHARED / "data" / "alpaca_en_demo.json"
    if alpaca.exists():
        raw = json.loads(alpaca.read_text())
        rows = [{"messages": [{"role": "user", "content": r["instruction"] + (f"\n\n{r['input']}" if r["input"] else "")},
                              {"role": "assistant", "content": r["output"]}]} for r in raw]
        return rows * copies, AutoTokenizer.from_pretrained(SHARED / "tokenizers" / "qwen25"), "alpaca x qwen2.5"
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import chat_rows
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rows = chat_rows(1000 * copies)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator((m["content"] for r in rows for m in r["messages"]),
                            trainers.BpeTrainer(vocab_size=500, special_tokens=["<|im_start|>", "<|im_end|>"]))
    return rows, PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>"), "generated"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--copies", type=int, default=10)
    args = parser.parse_args()
    os.environ["FTCORE_CACHE_DIR"] = tempfile.mkdtemp(prefix="ftcore-bench-cache-")

    import datasets

    from ftcore_plugins.common.chat import encode
    from ftcore_plugins.common.prepare import prepare
    from ftcore_plugins.templates.chatml import ChatMLTemplate

    rows, tok, what = load_rows_and_tokenizer(args.copies)
    template = ChatMLTemplate()
    data = datasets.Dataset.from_list(rows)
    texts = [template.render(r["messages"]) for r in rows]

    raw, ours = [], []
    for _ in range(args.repeat):  # interleaved, so drift hits both alike
        start = time.perf_counter()
        tok(texts)
        raw.append(time.perf_counter() - start)
        start = time.perf_counter()
        encode(data, tok, template, max_length=None)
        ours.append(time.perf_counter() - start)
    raw_s, ours_s = statistics.median(raw), statistics.median(ours)
    print(f"data: {len(rows)} rows ({what})")
    print(f"raw batched tokenizer(texts):      {len(rows) / raw_s:9.0f} rows/s")
    print(f"ftcore encode (render+mask+ids):   {len(rows) / ours_s:9.0f} rows/s")
    print(f"throughput ratio ftcore/raw:       {raw_s / ours_s:9.2f}")

    start = time.perf_counter()
    cold = prepare(data, tok, template, max_length=2048)
    cold_s = time.perf_counter() - start
    start = time.perf_counter()
    hit = prepare(data, tok, template, max_length=2048)
    hit_s = time.perf_counter() - start
    assert not cold.cache_hit and hit.cache_hit
    print(f"prepare cold: {cold_s:.3f} s, cache hit: {hit_s:.3f} s, hit/cold = {hit_s / cold_s:.1%}")


if __name__ == "__main__":
    main()
