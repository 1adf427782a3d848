"""A preference trainer with ``padding_free = true`` against padded batches, side by side, on the real DPO demo set.

    python benchmarks/padding_free.py [--trainer dpo|kto|orpo] [--rows 200] [--rounds 2] [--hidden 256]
                                      [--max-length 512]

Both arms are ``ftcore run`` (in this process) of one plan but for ``padding_free``: the DPO demo set
(../shared/fixtures/data/dpo_en_demo.json, the first ``--rows`` pairs), a tiny Llama (2 layers,
hidden ``--hidden``) with a BPE tokenizer of 4,096 tokens trained on the rows, LoRA r=16, batch 4,
``max_length`` 512, one epoch of ``--trainer`` (``kto`` takes each pair as a desirable and an
undesirable row), arms alternating. A callback inside the Trainer times the steps;
tokens/s counts the real (non-padding) positions of the policy's forwards with gradients (the collator's attention
mask, which both arms share) over the steps after the first two. Also printed: the padding the padded
arm computes and the largest difference between the arms' losses at any step.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import SCRATCH_PLAN, SHARED, StepRecorder, machine, median, run_ftcore  # noqa: E402

DPO = SHARED / "data" / "dpo_en_demo.json"

PLAN = SCRATCH_PLAN + """
[[stage]]
name = "pref"
trainer = "{trainer}"
data = "pairs"
adapter = {{ use = "lora", r = 16 }}
epochs = 1
batch_size = 4
max_length = {max_length}
learning_rate = 1e-4
logging_steps = 1
save_steps = 100000
padding_free = {free}
"""


def arm(work: Path, name: str, free: bool, args, recorder: StepRecorder) -> dict:
    plan = work / f"{name}.toml"
    plan.write_text(PLAN.format(source="pairs", name=name, data=DPO, rows=args.rows, free=str(free).lower(), trainer=args.trainer, layers=2,
                                hidden=args.hidden, intermediate=4 * args.hidden, max_length=args.max_length))
    counted = []

    def count(module, positional, kwargs):  # the policy's forwards: TRL's padded batch, before ours flattens it
        import torch

        mask = kwargs.get("attention_mask")  # the reference's (and KTO's KL) forwards run without gradients
        if mask is not None and module.training and torch.is_grad_enabled() and recorder.real:
            counted.append((len(recorder.begins), int(mask.sum()), mask.numel()))

    import transformers.trainer

    class Hook(transformers.TrainerCallback):
        def on_train_begin(self, a, state, control, model=None, **kw):
            self.handle = model.register_forward_pre_hook(count, with_kwargs=True)

        def on_train_end(self, a, state, control, **kw):
            self.handle.remove()

    transformers.trainer.DEFAULT_CALLBACKS.append(hook := Hook())
    try:
        run_ftcore(plan)
    finally:
        transformers.trainer.DEFAULT_CALLBACKS.remove(hook)
    seconds = recorder.step_seconds(args.warmup)
    timed = range(args.warmup + 1, args.warmup + 1 + len(seconds))
    real = sum(r for step, r, _ in counted if step in timed)
    return {"tokens_per_s": real / sum(seconds), "real": sum(r for _, r, _ in counted),
            "positions": sum(p for _, _, p in counted), "losses": recorder.losses, "steps": len(recorder.begins)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainer", choices=("dpo", "kto", "orpo"), default="dpo")
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not DPO.exists():
        sys.exit(f"needs the DPO demo set at {DPO}")
    work = Path(tempfile.mkdtemp(prefix="ftcore-padding-free-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)
    os.environ.setdefault("FTCORE_CACHE_DIR", str(work / "cache"))
    os.chdir(work)
    recorder = StepRecorder().install()
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for i in range(args.rounds):
        for free in ((False, True) if i % 2 == 0 else (True, False)):
            runs[free].append(arm(work, f"{'free' if free else 'padded'}{i}", free, args, recorder))
    rates = {f: median([r["tokens_per_s"] for r in runs[f]]) for f in runs}
    padded = runs[False][0]
    diff = max(abs(runs[True][0]["losses"][s] - v) for s, v in padded["losses"].items())
    ratio = rates[True] / rates[False]
    per_round = [f["tokens_per_s"] / p["tokens_per_s"] for f, p in zip(runs[True], runs[False])]
    print(f"machine: {machine()}")
    print(f"trainer {args.trainer}; data: {args.rows} pairs of {DPO.name}; hidden {args.hidden}, 2 layers, LoRA r=16, batch 4, "
          f"max_length {args.max_length}; {padded['steps']} steps; real tokens of the policy's forwards "
          f"{padded['real']:,} (padded arm: {1 - padded['real'] / padded['positions']:.1%} of its positions padding)")
    print()
    print("| arm | real tokens/s (median) | runs |")
    print("|---|---:|---:|")
    print(f"| padded (TRL's batches) | {rates[False]:.0f} | {len(runs[False])} |")
    print(f"| padding_free = true | {rates[True]:.0f} | {len(runs[True])} |")
    print()
    print(f"ratio padding-free/padded tokens/s: {ratio:.2f} (per round: {', '.join(f'{r:.2f}' for r in per_round)}); "
          f"largest loss difference at any step: {diff:.1e}")
    if args.json:
        args.json.write_text(json.dumps({"ratio": ratio, "tokens_per_s": {str(k): v for k, v in rates.items()},
                                         "max_loss_diff": diff, "real": {str(k): [r["real"] for r in v]
                                                                         for k, v in runs.items()}}))


if __name__ == "__main__":
    main()
