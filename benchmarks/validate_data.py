"""`ftcore validate --data` speed against just tokenizing the same rows, side by side in one run.

    python benchmarks/validate_data.py [--rows 10000] [--repeat 3] [--tiny]

Both arms start from the same chat JSONL file of ``--rows`` rows (a single bad row among them,
so the check has one line to report):

* tokenize: one batched ``tokenizer(texts)`` call on the rows' conversations, rendered with
  the same template beforehand (not timed): just the tokenizing, the least a run does with them;
* validate --data: ``check_plan_data`` on a plan using the file, as the command runs it after
  the plan is read: read (datasets), convert, render every row with its assistant spans through
  ``row_samples``, locate the bad row, print.

Both run in this process after a warm-up, so imports count in neither. The issue's bar is a
ratio validate/tokenize under 2. Uses the Alpaca rows (repeated) and the Qwen2.5 tokenizer from
../shared/fixtures when present, else (or with ``--generated``) short generated rows and a
tokenizer trained here; ``--tiny`` (100 rows, one repeat) is what the tests run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import interleaved_medians, validate_report  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "fixtures"
BAD = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}]}


def rows_and_tokenizer(n: int, folder: Path, generated: bool = False) -> tuple[list[dict], Path, str]:
    alpaca, qwen = SHARED / "data" / "alpaca_en_demo.json", SHARED / "tokenizers" / "qwen25"
    if alpaca.exists() and qwen.exists() and not generated:
        raw = json.loads(alpaca.read_text())
        rows = [{"messages": [{"role": "user", "content": r["instruction"] + (f"\n\n{r['input']}" if r["input"] else "")},
                              {"role": "assistant", "content": r["output"]}]} for r in raw]
        return [rows[i % len(rows)] for i in range(n)], qwen, "alpaca x qwen2.5"
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from ftcore.testing import chat_rows

    rows = chat_rows(n)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator((m["content"] for r in rows[:2000] for m in r["messages"]), trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(folder / "tok")
    return rows, folder / "tok", "generated"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="100 rows, one repeat: for the tests")
    parser.add_argument("--generated", action="store_true", help="short generated rows even when the fixtures exist")
    args = parser.parse_args()
    if args.tiny:
        args.rows, args.repeat = 100, 1
    folder = Path(tempfile.mkdtemp(prefix="ftcore-bench-validate-"))
    try:
        run(args, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # the rows, the tokenizer and the datasets cache


def run(args: argparse.Namespace, folder: Path) -> None:
    os.environ["HF_DATASETS_CACHE"] = str(folder / "datasets")  # a cold datasets cache, in both arms alike

    from transformers import AutoTokenizer

    from ftcore.plan import load_plan
    from ftcore.plugins import get_plugin_manager
    from ftcore_plugins.templates.chatml import ChatMLTemplate

    rows, tok_dir, what = rows_and_tokenizer(args.rows, folder, args.generated)
    bad_line = len(rows) // 2 + 1
    rows[bad_line - 1] = BAD
    data = folder / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plan_path = folder / "plan.toml"
    plan_path.write_text(f'[run]\nname = "bench"\n[model]\nuse = "scratch"\ntokenizer = "{tok_dir}"\n[template]\n'
                         f'use = "chatml"\n[data.chat]\nuse = "jsonl"\npath = "{data}"\non_error = "skip"\n'
                         '[[stage]]\nname = "sft"\ntrainer = "sft"\ndata = "chat"\nadapter = "lora"\n')
    plan = load_plan(plan_path, get_plugin_manager(entry_points=False).registry())
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    template = ChatMLTemplate()
    texts = [template.render(r["messages"], tokenizer) for r in rows]

    def tokenize() -> int:
        return sum(map(len, tokenizer(texts)["input_ids"]))

    tokens, report = tokenize(), validate_report(plan)  # warm-up: imports, templates, page cache
    raw_s, ours_s = interleaved_medians(tokenize, lambda: validate_report(plan), args.repeat)
    print(f"data: {len(rows):,} chat rows ({what}), {tokens:,} tokens; {args.repeat} repeat(s), median")
    print(report.rstrip())
    print(f"tokenize (tokenizer(texts), batched):  {raw_s:8.3f} s  {len(rows) / raw_s:9.0f} rows/s")
    print(f"validate --data (read+convert+render): {ours_s:8.3f} s  {len(rows) / ours_s:9.0f} rows/s")
    print(f"ratio validate/tokenize: {ours_s / raw_s:.2f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
