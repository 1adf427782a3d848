"""`ftcore validate --data` on chat rows with images, against the model's processor alone on the same rows,
side by side in one run; then its peak memory at growing row counts.

    python benchmarks/validate_images.py [--rows 2000] [--repeat 3] [--tiny]

The rows are LLaMA-Factory style (``<image>`` in the question, a JPEG path in ``images``), 320 x 240
pictures drawn here; the plan trains a tiny LLaVA (``scratch``) on them, with the real Llama 3
tokenizer from ../shared/fixtures when present (else a BPE tokenizer trained here).

* processor: what a run does with each row's image at the least: the file opened and decoded, and the
  plan's processor (its chat template's text and the picture) turned into the model's tensors, one row
  at a time, as the training collator does it batch by batch;
* validate --data: ``check_plan_data`` on the plan, as the command runs it once the plan is read: the
  rows read and converted, each image decoded once to check it (and dropped), each row rendered with
  its assistant spans, and the stage's data prepared.

Both run in this process after a warm-up, so imports count in neither. The issue's bar: a ratio
validate/processor under 2. Then each of ``--sizes`` rows is validated in a fresh process, and its
peak RSS (``ru_maxrss``) printed: memory that stays flat as the rows grow means no image is kept.
``--tiny`` (40 rows, one repeat, sizes 20 and 40) is what the tests run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import interleaved_medians, validate_report  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "fixtures"
COLOURS = ((220, 40, 40), (40, 170, 60), (40, 80, 220), (230, 200, 30))


def write_rows(folder: Path, n: int) -> Path:
    """``n`` rows, each its own 320 x 240 JPEG (a shape on a noisy background), and their JSONL file."""
    from PIL import Image, ImageDraw

    images = folder / "images"
    images.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    noise = Image.effect_noise((320, 240), 40).convert("RGB")
    with open(folder / "rows.jsonl", "w") as fh:
        for i in range(n):
            picture = Image.blend(noise, Image.new("RGB", (320, 240), rng.choice(COLOURS)), 0.5)
            x, y = rng.randint(0, 200), rng.randint(0, 120)
            ImageDraw.Draw(picture).ellipse((x, y, x + 100, y + 100), fill=rng.choice(COLOURS))
            picture.save(images / f"{i:05d}.jpg", quality=85)
            fh.write(json.dumps({"messages": [{"role": "user", "content": "<image>What is in the picture?"},
                                              {"role": "assistant", "content": f"A shape, number {i}."}],
                                 "images": [f"images/{i:05d}.jpg"]}) + "\n")
    return folder / "rows.jsonl"


def tokenizer_folder(folder: Path) -> Path:
    llama3 = SHARED / "tokenizers" / "llama3"
    if llama3.is_dir():
        return llama3
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["What is in the picture? A shape, number 1."] * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|end_of_text|>"], show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end_of_text|>").save_pretrained(folder / "tok")
    return folder / "tok"


def write_plan(folder: Path, data: Path, tokenizer: Path) -> Path:
    plan = folder / "plan.toml"
    plan.write_text(f'[run]\nname = "bench"\n[model]\nuse = "scratch"\narchitecture = "llava"\nhidden_size = 32\n'
                    f'num_layers = 1\nnum_heads = 2\ntokenizer = "{tokenizer}"\n[template]\nuse = "native"\n'
                    f'[data.rows]\nuse = "jsonl"\npath = "{data}"\n'
                    '[[stage]]\nname = "sft"\ntrainer = "sft"\ndata = "rows"\nadapter = "full"\n')
    return plan


def validate_peak(plan: Path) -> float:
    """Peak RSS (MiB) of a fresh process that runs ``check_plan_data`` on ``plan``: its VmHWM, which starts
    anew at exec (``ru_maxrss`` keeps the parent's peak across fork and exec)."""
    code = ("import io\n"
            "from ftcore.plan import load_plan\nfrom ftcore.plugins import get_plugin_manager\n"
            "from ftcore_plugins.data._check import check_plan_data\n"
            f"plan = load_plan({str(plan)!r}, get_plugin_manager(entry_points=False).registry())\n"
            "out = io.StringIO()\nassert check_plan_data(plan, out) == 0, out.getvalue()\n"
            "print(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(done.stdout.split()[-1]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="*", default=[500, 1000, 2000, 4000])
    parser.add_argument("--tiny", action="store_true", help="40 rows, one repeat, sizes 20 and 40: for the tests")
    args = parser.parse_args()
    if args.tiny:
        args.rows, args.repeat, args.sizes = 40, 1, [20, 40]
    folder = Path(tempfile.mkdtemp(prefix="ftcore-bench-images-"))
    try:
        run(args, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run(args: argparse.Namespace, folder: Path) -> None:
    os.environ["HF_DATASETS_CACHE"] = str(folder / "datasets")  # a cold datasets cache, in both arms alike
    os.environ["FTCORE_CACHE_DIR"] = str(folder / "cache")

    from PIL import Image

    from ftcore.plan import load_plan
    from ftcore.plugins import get_plugin_manager
    from ftcore_plugins.data._check import plan_tokenizer

    tokenizer = tokenizer_folder(folder)
    data = write_rows(folder, args.rows)
    plan_path = write_plan(folder, data, tokenizer)
    plan = load_plan(plan_path, get_plugin_manager(entry_points=False).registry())
    processor = plan_tokenizer(plan, None)[0].ftcore_processor
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    parts = [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]},
              {"role": "assistant", "content": [{"type": "text", "text": r["messages"][1]["content"]}]}] for r in rows]
    texts = [processor.apply_chat_template(p) for p in parts]

    def process() -> int:
        tokens = 0
        for text, row in zip(texts, rows):
            with Image.open(folder / row["images"][0]) as picture:
                out = processor(text=[text], images=[[picture.convert("RGB")]], add_special_tokens=False,
                                return_tensors="pt")
            tokens += out["input_ids"].shape[1]
        return tokens

    tokens, report = process(), validate_report(plan)  # warm-up: imports, templates, page cache
    raw_s, ours_s = interleaved_medians(process, lambda: validate_report(plan), args.repeat)
    print(f"data: {len(rows):,} chat rows, one 320x240 JPEG each, {tokens:,} tokens with the images; "
          f"{args.repeat} repeat(s), median")
    print(report.rstrip())
    print(f"processor (decode + processor, per row): {raw_s:8.3f} s  {len(rows) / raw_s:8.0f} rows/s")
    print(f"validate --data:                         {ours_s:8.3f} s  {len(rows) / ours_s:8.0f} rows/s")
    print(f"ratio validate/processor: {ours_s / raw_s:.2f}")
    sys.stdout.flush()
    lines = data.read_text().replace('"images/', f'"{folder}/images/').splitlines()  # absolute paths
    for n in args.sizes:  # the same pictures, repeated: the memory of n rows, not of n files' pages
        sub = folder / f"size_{n}"
        sub.mkdir()
        (sub / "rows.jsonl").write_text("".join(lines[i % len(lines)] + "\n" for i in range(n)))
        peak = validate_peak(write_plan(sub, sub / "rows.jsonl", tokenizer))
        print(f"validate --data peak RSS, {n:>6,} rows: {peak:7.1f} MiB")
        sys.stdout.flush()
    print(f"this process: peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.1f} MiB")


if __name__ == "__main__":
    main()
