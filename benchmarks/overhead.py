"""What ftcore's training machinery costs per step: its ``sft`` trainer against a raw TRL
``SFTTrainer`` doing the same work, side by side in one process.

    python benchmarks/overhead.py [--blocks 4] [--steps 50] [--warmup 10]

Both arms train the same tiny Llama (hidden 64, 2 layers, LoRA r=16 on every linear layer) on
the same token ids (ftcore tokenizes once; the raw arm gets those ids with their labels), batch 8,
fp32, AdamW, gradient clipping 1.0, a log every 10 steps, no checkpoint. The ftcore arm is
``ftcore run`` in this process (plan, Runner, its progress bar drawn as on a terminal, metrics.jsonl,
checkpoint keeper, signal handler, stability guard); the raw arm is ``SFTTrainer(model, args=SFTConfig(...),
peft_config=LoraConfig(...))`` with TRL's default callbacks (its tqdm bar). One callback, installed
first in both, times each step (from one ``on_step_begin`` to the next) and counts the tokens the
model saw. The arms alternate in blocks (A B, B A, ...) so the load of a shared machine hits both;
each block trains ``--warmup`` untimed steps, then ``--steps`` timed ones.

Prints the median step time of each arm, the ratio ftcore/raw of the medians over all blocks and
its spread over the blocks (the issue's goal: at most 1.03), and checks that both arms saw the
same tokens at every step.
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
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _bench import StepRecorder, machine, median, quiet, run_ftcore  # noqa: E402

STEP_EVENTS = ("on_step_begin", "on_pre_optimizer_step", "on_optimizer_step", "on_step_end", "on_log")


def time_callbacks(costs: dict) -> None:
    """Time every callback's step events in every Trainer from here on: ``costs[(arm callback class,
    event)]`` accumulates seconds. Wraps each callback instance's methods once, then lets the
    handler's own loop call them."""
    import time

    from transformers.trainer_callback import CallbackHandler

    original = CallbackHandler.call_event

    def call_event(self, event, *args, **kwargs):
        for callback in self.callbacks:
            if event in STEP_EVENTS and event not in vars(callback):
                method, key = getattr(callback, event), (type(callback).__name__, event)

                def timed(*a, _method=method, _key=key, **kw):
                    start = time.perf_counter()
                    try:
                        return _method(*a, **kw)
                    finally:
                        costs[_key] = costs.get(_key, 0.0) + time.perf_counter() - start
                setattr(callback, event, timed)
        return original(self, event, *args, **kwargs)

    CallbackHandler.call_event = call_event

MODEL = dict(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=256, max_position_embeddings=256)
TRAIN = dict(batch_size=8, max_length=128, learning_rate=1e-3, logging_steps=10, seed=7)
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0)

PLAN = """
[run]
name = "{name}"
seed = {seed}
output_dir = "runs"

[model]
use = "scratch"
hidden_size = {hidden_size}
num_layers = {num_layers}
num_heads = {num_heads}
intermediate_size = {intermediate_size}
max_position_embeddings = {max_position_embeddings}
tokenizer_data = ["chat"]
vocab_size = 512

[template]
use = "chatml"

[data.chat]
use = "jsonl"
path = "chat.jsonl"

[[stage]]
name = "sft"
trainer = "sft"
data = "chat"
adapter = {{ use = "lora", r = {r}, lora_alpha = {lora_alpha}, lora_dropout = {lora_dropout} }}
max_steps = {max_steps}
batch_size = {batch_size}
max_length = {max_length}
learning_rate = {learning_rate}
logging_steps = {logging_steps}
save_steps = 100000
"""


def ftcore_arm(folder: Path, name: str, max_steps: int, recorder: StepRecorder) -> dict:
    plan = folder / f"{name}.toml"
    plan.write_text(PLAN.format(name=name, max_steps=max_steps, **MODEL, **TRAIN, **LORA))
    summary = run_ftcore(plan)
    return {"steps": recorder.step_seconds(), "real": recorder.real, "summary": summary}


def raw_arm(folder: Path, tokenizer_dir: Path, rows, max_steps: int, recorder: StepRecorder) -> dict:
    """Raw TRL: the same model config, the same token ids, the equivalent SFTConfig."""
    import torch
    from peft import LoraConfig
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = AutoConfig.for_model(
        "llama", vocab_size=len(tokenizer), hidden_size=MODEL["hidden_size"],
        num_hidden_layers=MODEL["num_layers"], num_attention_heads=MODEL["num_heads"],
        num_key_value_heads=MODEL["num_heads"], intermediate_size=MODEL["intermediate_size"],
        max_position_embeddings=MODEL["max_position_embeddings"], tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(TRAIN["seed"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    args = SFTConfig(
        output_dir=str(folder / "raw"), max_steps=max_steps, per_device_train_batch_size=TRAIN["batch_size"],
        learning_rate=TRAIN["learning_rate"], lr_scheduler_type="linear", optim="adamw_torch", max_grad_norm=1.0,
        weight_decay=0.0, bf16=False, activation_checkpointing=False,  # TRL defaults both on; ftcore on CPU: off
        logging_steps=TRAIN["logging_steps"], save_strategy="steps", save_steps=100000, report_to="none",
        seed=TRAIN["seed"], max_length=TRAIN["max_length"], packing=False, dataloader_pin_memory=False)
    lora = LoraConfig(task_type="CAUSAL_LM", target_modules="all-linear", **LORA)
    with quiet():
        trainer = SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer,
                             peft_config=lora)
        trainer.train()
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    return {"steps": recorder.step_seconds(), "real": recorder.real, "trainable": trainable}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=4, help="alternating blocks per arm")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per block")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps at the start of each block")
    parser.add_argument("--rows", type=int, default=2000, help="chat rows to train on")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    import datasets

    from conftest import chat_rows, write_jsonl
    from ftcore_plugins.common.prepare import prepare
    from ftcore_plugins.templates.chatml import ChatMLTemplate
    from transformers import AutoTokenizer

    work = Path(tempfile.mkdtemp(prefix="ftcore-overhead-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # runs, models and cache are scratch
    os.environ.setdefault("FTCORE_CACHE_DIR", str(work / "cache"))
    write_jsonl(work / "chat.jsonl", chat_rows(args.rows))
    recorder = StepRecorder().install()
    costs: dict[tuple[str, str], float] = {}
    time_callbacks(costs)
    steps_run = 0
    max_steps = args.warmup + args.steps + 1  # +1: the last step is not timed
    arms: dict[str, list[dict]] = {"ftcore": [], "raw": []}
    token_ids = None
    for block in range(args.blocks):
        order = ("ftcore", "raw") if block % 2 == 0 else ("raw", "ftcore")
        for arm in order:
            if arm == "ftcore":
                result = ftcore_arm(work, f"ftcore{block}", max_steps, recorder)
                tokenizer_dir = work / "runs" / f"ftcore{block}" / "model" / "tokenizer"
                if token_ids is None:  # the ids ftcore trained on, for the raw arm
                    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
                    rows = datasets.Dataset.from_json(str(work / "chat.jsonl"))
                    token_ids = prepare(rows, tokenizer, ChatMLTemplate(), max_length=TRAIN["max_length"]).dataset
                    raw_tokenizer = tokenizer_dir
            else:
                result = raw_arm(work, raw_tokenizer, token_ids, max_steps, recorder)
            steps_run += max_steps
            result["steps"] = result["steps"][args.warmup:]
            arms[arm].append(result)

    same_tokens = all(f["real"] == r["real"] for f, r in zip(arms["ftcore"], arms["raw"]))
    ours = [s for r in arms["ftcore"] for s in r["steps"]]
    raw = [s for r in arms["raw"] for s in r["steps"]]
    per_block = [median(f["steps"]) / median(r["steps"]) for f, r in zip(arms["ftcore"], arms["raw"])]
    ratio = median(ours) / median(raw)
    trainable_ftcore = arms["ftcore"][0]["summary"]["stages"]["sft"].get("trainable_params")
    tokens_per_step = median([sum(r["real"]) / len(r["real"]) for r in arms["raw"]])
    print(f"machine: {machine()}")
    print(f"{args.blocks} alternating blocks x {args.steps} timed steps per arm (after {args.warmup} warm-up "
          f"steps each); {tokens_per_step:.0f} real tokens per step; same tokens at every step: {same_tokens}; "
          f"trainable parameters raw {arms['raw'][0]['trainable']:,}, ftcore {trainable_ftcore}")
    print()
    print("| arm | median step ms | mean step ms | steps timed |")
    print("|---|---:|---:|---:|")
    for name, steps in (("raw TRL SFTTrainer", raw), ("ftcore sft", ours)):
        print(f"| {name} | {median(steps) * 1e3:.2f} | {sum(steps) / len(steps) * 1e3:.2f} | {len(steps)} |")
    print()
    print("Callbacks' step events (on_step_begin/end, on_pre_optimizer_step, on_optimizer_step, on_log), "
          "mean per step over both arms' steps (StepRecorder is the benchmark's own):")
    print()
    print("| callback | ms per step |")
    print("|---|---:|")
    per_class: dict[str, float] = {}
    for (name, _), total in costs.items():
        per_class[name] = per_class.get(name, 0.0) + total
    for name, total in sorted(per_class.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {total / (steps_run / 2) * 1e3:.3f} |")
    print()
    print(f"ratio ftcore/raw of the median step time: {ratio:.3f} "
          f"(per block: {', '.join(f'{r:.3f}' for r in per_block)}; min {min(per_block):.3f}, "
          f"max {max(per_block):.3f}); goal <= 1.03: {'met' if ratio <= 1.03 else 'missed'}")
    print(f"ratio of the mean step time: {(sum(ours) / len(ours)) / (sum(raw) / len(raw)):.3f}")
    if args.json:
        args.json.write_text(json.dumps({"ratio": ratio, "per_block": per_block, "same_tokens": same_tokens,
                                         "ftcore_ms": [s * 1e3 for s in ours], "raw_ms": [s * 1e3 for s in raw],
                                         "ftcore_real": [r["real"] for r in arms["ftcore"]],
                                         "raw_real": [r["real"] for r in arms["raw"]],
                                         "callback_ms_per_step": {k: v / (steps_run / 2) * 1e3
                                                                  for k, v in per_class.items()}}))


if __name__ == "__main__":
    main()
