"""Training throughput of ``sft`` with ``packing = true`` against ``packing = false``, side by side.

    python benchmarks/packing.py [--rows 400] [--rounds 2] [--hidden 64] [--layers 2]
                                 [--arms unpacked packed packed-mask]

Every arm is ``ftcore run`` (in this process) of the same plan but for ``packing``: a tiny Llama
(hidden ``--hidden``, ``--layers`` layers, full fine-tuning, fp32) with a BPE tokenizer trained on the rows,
batch 8, ``max_length`` 512, one epoch over the same rows, so all train on the same real tokens. The
rows are the real Alpaca demo set (../shared/fixtures, 999 rows of instruction / input / output) when
it is there, otherwise generated rows whose lengths follow a log-normal shape like Alpaca's (said in
the output). The arms alternate (``--rounds`` times each). ``packed`` is the default path (one row
of a batch's bins, SDPA within each sample); ``packed-mask`` the same batches with transformers'
block-diagonal mask over the whole row, as a packed stage ran before and as TRL runs on SDPA.

A callback inside the Trainer counts, at every forward, the positions the model computed and the
real ones (not padding by the attention mask; packed batches are padding-free, one row of
concatenated samples, so every position is real). Prints tokens/s of real tokens over the timed
steps (all but the first ``--warmup``), the padding fraction measured from the batches
(pad positions / all positions), and each arm's ratio to unpacked.

Two bounds are printed. The padding bound, 1 / (1 - unpacked padding), assumes every position costs
the same. ftcore's loss projects only the trained positions through the output layer, in both arms,
so that part of the work does not shrink with packing: the FLOP bound counts 6 x the layers'
matrix parameters per computed position and 6 x vocabulary x hidden per trained position (the
positions with a label, counted in the batches), and leaves attention out (which packing cuts by
more than the padding).
"""
from __future__ import annotations

import argparse
import atexit
import json
import math
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import SCRATCH_PLAN, SHARED, StepRecorder, machine, median, run_ftcore  # noqa: E402

ALPACA = SHARED / "data" / "alpaca_en_demo.json"

PLAN = SCRATCH_PLAN + """
[[stage]]
name = "sft"
trainer = "sft"
data = "rows"
adapter = "full"
epochs = 1
batch_size = {batch_size}
max_length = {max_length}
learning_rate = 1e-3
packing = {packing}
save_steps = 100000
"""


def generated_rows(n: int, seed: int = 0) -> list[dict]:
    """Alpaca-shaped rows: short instructions, answers whose word counts are log-normal
    (median ~60 words, a long tail), as in the Alpaca demo set."""
    rng = random.Random(seed)
    words = ["the", "a", "model", "data", "answer", "list", "write", "explain", "three", "ways", "to", "of",
             "and", "is", "for", "example", "first", "second", "because", "use", "simple", "water", "city"]
    rows = []
    for _ in range(n):
        answer = max(1, min(600, int(math.exp(rng.gauss(math.log(60), 0.9)))))
        rows.append({"instruction": " ".join(rng.choices(words, k=rng.randint(5, 25))), "input": "",
                     "output": " ".join(rng.choices(words, k=answer))})
    return rows


ARMS = {
    "unpacked": "unpacked",
    "packed": "packed (bfd, padding-free, per-sample SDPA: the default)",
    "packed-mask": "packed (bfd, padding-free, SDPA with transformers' mask over the row: TRL's path)",
}


def arm(work: Path, data: Path, name: str, kind: str, args, recorder: StepRecorder) -> dict:
    packing = kind != "unpacked"
    plan = work / f"{name}.toml"
    plan.write_text(PLAN.format(source="rows", name=name, data=data, rows=args.rows, packing=str(packing).lower(),
                                hidden=args.hidden, intermediate=4 * args.hidden, max_length=args.max_length,
                                batch_size=args.batch_size, layers=args.layers))
    if kind == "packed-mask":  # what a packed stage ran before per-sample attention, and what TRL runs
        import ftcore_plugins.trainers.sft as sft

        # a path that keeps SDPA on TRL's one row: transformers' packed-sequence mask over the whole row
        default, sft.choose_path = sft.choose_path, lambda option, model, device: "sdpa"
        try:
            run_ftcore(plan)
        finally:
            sft.choose_path = default
    else:
        run_ftcore(plan)
    seconds = recorder.step_seconds(args.warmup)
    timed = recorder.real[args.warmup:args.warmup + len(seconds)]
    report = json.loads((work / "runs" / name / "data_report.json").read_text())["sft/train"]
    return {"tokens_per_s": sum(timed) / sum(seconds), "real": sum(recorder.real), "total": sum(recorder.total),
            "trained": sum(recorder.trained), "steps": len(recorder.begins), "report": report}


def flop_bound(unpacked: dict, packed: dict, hidden: int, layers: int, vocab: int = 4096) -> float:
    """The packed/unpacked speed-up if time followed the matrix products' FLOPs: the layers' cost per
    computed position (attention and MLP projections: 4 h^2 + 3 h * 4h per layer), the output
    layer's per trained position (ftcore's loss skips the rest)."""
    per_position, per_trained = 6 * layers * 16 * hidden ** 2, 6 * vocab * hidden
    cost = {k: r["total"] * per_position + r["trained"] * per_trained for k, r in (("u", unpacked), ("p", packed))}
    return cost["u"] / cost["p"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each arm, alternating")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of each run")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--arms", nargs="+", choices=sorted(ARMS), default=["unpacked", "packed"])
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if "unpacked" not in args.arms:
        parser.error("--arms needs unpacked: the ratios are to it")

    work = Path(tempfile.mkdtemp(prefix="ftcore-packing-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # runs, models and cache are scratch
    os.environ.setdefault("FTCORE_CACHE_DIR", str(work / "cache"))
    if ALPACA.exists():
        data, what = ALPACA, f"the Alpaca demo set ({ALPACA}), first {args.rows} rows"
    else:
        data = work / "alpaca_like.json"
        data.write_text(json.dumps(generated_rows(args.rows)))
        what = f"{args.rows} generated rows with Alpaca-like log-normal lengths (the Alpaca fixture is absent)"
    recorder = StepRecorder().install()
    runs: dict[str, list[dict]] = {kind: [] for kind in args.arms}
    for i in range(args.rounds):
        for kind in (args.arms if i % 2 == 0 else args.arms[::-1]):
            runs[kind].append(arm(work, data, f"{kind}{i}", kind, args, recorder))

    report = runs["unpacked"][0]["report"]
    rates = {k: median([r["tokens_per_s"] for r in runs[k]]) for k in runs}
    padding = {k: 1 - sum(r["real"] for r in runs[k]) / sum(r["total"] for r in runs[k]) for k in runs}
    same_tokens = len({r["real"] for k in runs for r in runs[k]}) == 1
    print(f"machine: {machine()}")
    print(f"data: {what}; {report['tokens']:,} tokens, length p50/p90/max {report.get('length_p50')}/"
          f"{report.get('length_p90')}/{report.get('length_max')}; model hidden {args.hidden}, {args.layers} layers; "
          f"batch {args.batch_size}, max_length {args.max_length}; same real tokens in every run: {same_tokens}; "
          f"the padding bound (1 / (1 - unpacked padding)): {1 / (1 - padding['unpacked']):.2f}")
    if "packed" in runs:
        bound = flop_bound(runs["unpacked"][0], runs["packed"][0], args.hidden, args.layers)
        print(f"trained positions: {runs['unpacked'][0]['trained']:,} unpacked, {runs['packed'][0]['trained']:,} packed; "
              f"the FLOP bound with ftcore's loss: {bound:.2f}")
    print()
    print("| arm | real tokens/s (median of runs) | runs | steps | padding fraction (measured) | "
          "data report: predicted padding / unfilled bins | ratio to unpacked (per round) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    ratios = {}
    for kind in runs:
        r = runs[kind][0]["report"]
        predicted = r["padding_fraction_unpacked"] if kind == "unpacked" else r["padding_fraction_packed"]
        ratios[kind] = rates[kind] / rates["unpacked"]
        per_round = [a["tokens_per_s"] / u["tokens_per_s"] for a, u in zip(runs[kind], runs["unpacked"])]
        print(f"| {ARMS[kind]} | {rates[kind]:.0f} | {len(runs[kind])} | {runs[kind][0]['steps']} | "
              f"{padding[kind]:.1%} | {predicted:.1%} | {ratios[kind]:.2f} ({', '.join(f'{x:.2f}' for x in per_round)}) |")
    print("(the data report's packed figure is the unfilled share of the max_length bins; padding-free batches "
          "concatenate the samples and compute no pad positions)")
    if "packed" in runs:
        print()
        print(f"ratio packed/unpacked tokens/s: {ratios['packed']:.2f}; padding packed {padding['packed']:.1%}; "
              f"{ratios['packed'] / bound:.0%} of the FLOP bound")
    if args.json:
        args.json.write_text(json.dumps({"ratio": ratios, "tokens_per_s": rates, "padding": padding,
                                         "trained": {k: [r["trained"] for r in runs[k]] for k in runs},
                                         "real": {k: [r["real"] for r in runs[k]] for k in runs},
                                         "report": report}))


if __name__ == "__main__":
    main()
