"""Training throughput, peak memory and MFU of ftcore's ``sft`` against plain HF + TRL defaults,
on models built from architecture configs (random init, nothing downloaded), side by side.

    python benchmarks/gpu_throughput.py [--runs 8b-lora-2048,...] [--steps 50] [--append-results]
    python benchmarks/gpu_throughput.py --tiny      # CPU: a tiny config, a few steps (what the tests run)

Runs (GPU): LoRA and QLoRA (nf4) of Llama-3-8B at sequence lengths 2048 and 8192, and full
fine-tuning of a Llama-3.2-1B-shaped model at 2048. Each run saves the random-init model once
(bf16 on a GPU) with a tokenizer (Llama 3's from ../shared/fixtures when there, else a BPE trained
here), and trains it twice in this process on the same synthetic rows (chat rows of repeated
words, lengths log-normal with median max_length/4, capped at max_length: real lengths, not
full-length rows):

* baseline: ``SFTTrainer(model, args=SFTConfig(...), peft_config=LoraConfig(...))`` with TRL's
  defaults (bf16, gradient checkpointing) and only what must be equal set: batch size,
  max_length, learning rate, steps, a log every step; it trains on the token ids ftcore prepared.
* ftcore: ``ftcore run`` of a plan (``hf`` loader, ``lora`` adapter, ``nf4`` for QLoRA) with ftcore's
  defaults plus the speed options it has: ``packing = true`` (best-fit, padding-free: one row of
  concatenated samples, position ids restart per sample) and ``gradient_checkpointing = true``.
* ftcore + OPTION (``--options``): the ftcore arm with one speed or memory option on top, each
  its own arm (``OPTIONS`` below: attention kernels, Liger, NEFTune, compile, loss kernels,
  optimizers, and packing off).
  Those that need CUDA are listed as skipped on a machine without it, so the first run on a GPU
  measures them all with one command: ``--options all``.

Measured per arm: real (non-padding) tokens/s over the timed steps (a callback counts the tokens
each forward saw), peak memory (``torch.cuda.max_memory_allocated``; on CPU the process's peak RSS
from ``ftcore.memory``), MFU = FLOPs/s / peak, with FLOPs per token 4*N + 2*N_trainable (LoRA,
QLoRA) or 6*N (full), N = the parameters used in matmuls (all but the input embedding, the LM head
counted once), attention FLOPs left out, peak = the GPU's dense bf16 peak (``--peak-tflops``; MFU
is left out on CPU unless given). Loss: the mean of each arm's last 10 per-step losses, and the
largest per-step difference (the arms' batches are the same only when ftcore does not pack).
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import gc
import json
import math
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import ROOT, SHARED, StepRecorder, machine, quiet, run_ftcore  # noqa: E402

ARCHITECTURES = {  # transformers LlamaConfig fields
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192,
               tie_word_embeddings=False),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192,
               tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=256, vocab_size=512, max_position_embeddings=256, tie_word_embeddings=True),
}
# name: (architecture, method, max_length, batch size): about 16k positions per step on the GPU
RUNS = {
    "8b-lora-2048": ("8b", "lora", 2048, 8),
    "8b-lora-8192": ("8b", "lora", 8192, 2),
    "8b-qlora-2048": ("8b", "qlora", 2048, 8),
    "8b-qlora-8192": ("8b", "qlora", 8192, 2),
    "1b-full-2048": ("1b", "full", 2048, 8),
}
TINY_RUNS = {"tiny-lora-128": ("tiny", "lora", 128, 4), "tiny-qlora-128": ("tiny", "qlora", 128, 4),
             "tiny-full-128": ("tiny", "full", 128, 4)}
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}  # dense bf16
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0)
LEARNING_RATE = 2e-4

PLAN = """
[run]
name = "{name}"
seed = 7
output_dir = "runs"

[model]
use = "hf"
path = "{model}"
dtype = "{dtype}"
{model_extra}

{quantizer}

[template]
use = "chatml"

[data.rows]
use = "jsonl"
path = "rows.jsonl"

[[stage]]
name = "sft"
trainer = "sft"
data = "rows"
adapter = {adapter}
max_steps = {max_steps}
batch_size = {batch_size}
max_length = {max_length}
learning_rate = {learning_rate}
logging_steps = 1
save_steps = 1000000
packing = {packing}
gradient_checkpointing = true
{stage_extra}
"""
# ftcore arms with one option on top of its defaults: name -> ([model] lines, [[stage]] lines, needs CUDA)
OPTIONS = {
    "sdpa": ('attn_implementation = "sdpa"', "", False),
    "eager": ('attn_implementation = "eager"', "", False),
    "flash-attention-2": ('attn_implementation = "flash_attention_2"', "", True),
    "flash-attention-3": ('attn_implementation = "flash_attention_3"', "", True),
    "flex-attention": ('attn_implementation = "flex_attention"', "", True),
    "liger": ("", "liger = true", True),
    "neftune": ("", "neftune_noise_alpha = 5.0", False),
    "compile": ("", "compile = true", False),
    "unpacked": ("", "", False),  # packing = false: what packing (per-sample attention, or varlen flash) buys
    "loss-full": ("", 'loss_kernel = "full"', False),
    "loss-trl": ("", 'loss_kernel = "trl"', False),
    "adamw-fused": ("", 'optimizer = "adamw_torch_fused"', False),
    "adamw-8bit": ("", 'optimizer = "adamw_8bit"', False),
    "paged-adamw-8bit": ("", 'optimizer = "paged_adamw_8bit"', False),
    "adafactor": ("", 'optimizer = "adafactor"', False),
    "lion-8bit": ("", 'optimizer = "lion_8bit"', False),
}


def synthetic_rows(n: int, max_length: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "model", "train", "token", "data", "answer", "question", "the", "a"]
    rows = []
    for _ in range(n):
        length = max(8, min(max_length, int(math.exp(rng.gauss(math.log(max_length / 4), 0.9)))))
        prompt = rng.randint(4, max(4, length // 5))
        rows.append({"messages": [{"role": "user", "content": " ".join(rng.choices(words, k=prompt))},
                                  {"role": "assistant", "content": " ".join(rng.choices(words, k=length - prompt))}]})
    return rows


def tokenizer_for(arch: str, rows: list[dict]):
    """Llama 3's real tokenizer for the real configs when the fixture is there; else a BPE trained on the rows."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if arch != "tiny" and (SHARED / "tokenizers" / "llama3").exists():
        tokenizer = AutoTokenizer.from_pretrained(SHARED / "tokenizers" / "llama3")
    else:
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        vocab = min(ARCHITECTURES[arch]["vocab_size"], 32000)
        tok.train_from_iterator((m["content"] for r in rows for m in r["messages"]), trainers.BpeTrainer(
            vocab_size=vocab, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], show_progress=False))
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                            additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def save_random_model(folder: Path, arch: str, tokenizer, dtype) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    fields = dict(ARCHITECTURES[arch])
    fields["vocab_size"] = max(fields["vocab_size"], len(tokenizer))
    config = LlamaConfig(**fields, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del model


def matmul_params(model) -> int:
    """Parameters used in matmuls: all but the input embedding (a lookup); a tied LM head counted once.
    4-bit weights counted unpacked (two values per stored byte)."""
    seen, total = set(), 0
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    for p in model.parameters():
        if id(p) in seen or (p is embedding and p is not head):
            continue
        seen.add(id(p))
        total += p.numel() * (2 if p.__class__.__name__ == "Params4bit" else 1)
    return total


def peak_memory_reset() -> None:
    import torch

    from ftcore import memory

    memory.reset_peak()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_memory_gib() -> float:
    import torch

    from ftcore import memory

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return memory.snapshot()["peak_rss_mib"] / 1024


class ModelProbe(StepRecorder):
    """StepRecorder that also keeps the trained model's parameter counts."""

    def on_train_begin(self, args, state, control, model=None, **kw):
        super().on_train_begin(args, state, control, model=model, **kw)
        self.n_matmul = matmul_params(model)
        self.n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)


def baseline_arm(work: Path, folder: Path, method: str, max_length: int, batch_size: int, steps: int, token_ids,
                 dtype, tokenizer) -> None:
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    from trl import SFTConfig, SFTTrainer

    kwargs = {}
    if method == "qlora":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16)
        if torch.cuda.is_available():
            kwargs["device_map"] = {"": 0}  # 4-bit weights are placed at load; the Trainer cannot move them
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs)  # the Trainer moves it to the GPU
    args = SFTConfig(output_dir=str(work / "baseline"), max_steps=steps, per_device_train_batch_size=batch_size,
                     max_length=max_length, learning_rate=LEARNING_RATE, logging_steps=1, save_strategy="no",
                     report_to="none", seed=7,
                     **({} if torch.cuda.is_available() else {"bf16": False}))  # TRL's default bf16 refuses a CPU
    peft = None if method == "full" else LoraConfig(task_type="CAUSAL_LM", target_modules="all-linear", **LORA)
    with quiet():
        SFTTrainer(model=model, args=args, train_dataset=token_ids, processing_class=tokenizer,
                   peft_config=peft).train()


def measure(recorder: ModelProbe, warmup: int, method: str, peak_flops: float | None) -> dict:
    seconds = recorder.step_seconds(warmup)
    tokens = sum(recorder.real[warmup:warmup + len(seconds)])
    rate = tokens / sum(seconds)
    n, trainable = recorder.n_matmul, recorder.n_trainable
    flops_per_token = 6 * n if method == "full" else 4 * n + 2 * trainable
    losses = [recorder.losses[k] for k in sorted(recorder.losses)]
    return {"tokens_per_s": rate, "timed_tokens": tokens, "timed_steps": len(seconds),
            "tokens_per_step": recorder.real, "positions_per_step": recorder.total,
            "peak_gib": peak_memory_gib(), "n_matmul": n, "n_trainable": trainable,
            "mfu": rate * flops_per_token / peak_flops if peak_flops else None, "losses": losses}


def run_one(name: str, spec: tuple, args, peak_flops: float | None) -> dict:
    import datasets
    import torch

    from ftcore_plugins.common.prepare import prepare
    from ftcore_plugins.templates.chatml import ChatMLTemplate

    arch, method, max_length, batch_size = spec
    work = Path(tempfile.mkdtemp(prefix=f"ftcore-gpu-{name}-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # runs, models and cache are scratch
    os.environ.setdefault("FTCORE_CACHE_DIR", str(work / "cache"))
    gpu = torch.cuda.is_available()
    dtype = torch.bfloat16 if gpu else torch.float32
    rows = synthetic_rows(args.rows or batch_size * (args.steps + 2) * 4, max_length)
    (work / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = tokenizer_for(arch, rows)
    folder = work / "model"
    save_random_model(folder, arch, tokenizer, dtype)
    token_ids = prepare(datasets.Dataset.from_list(rows), tokenizer, ChatMLTemplate(), max_length=max_length).dataset
    recorder = ModelProbe().install()
    results = {}
    for arm in ("baseline", "ftcore", *args.options):
        if arm in OPTIONS and OPTIONS[arm][2] and not gpu:
            results[f"ftcore+{arm}"] = {"skipped": "needs CUDA"}
            continue
        gc.collect()  # the previous arm's model and optimizer are gone before the peak is reset
        if gpu:
            torch.cuda.empty_cache()
        peak_memory_reset()
        if arm == "baseline":
            baseline_arm(work, folder, method, max_length, batch_size, args.steps, token_ids, dtype, tokenizer)
        else:
            adapter = '"full"' if method == "full" else \
                "{{ use = \"lora\", r = {r}, lora_alpha = {lora_alpha}, lora_dropout = {lora_dropout} }}".format(**LORA)
            model_extra, stage_extra, _ = OPTIONS.get(arm, ("", "", False))
            plan = work / f"{arm}.toml"
            plan.write_text(PLAN.format(name=arm, model=folder, dtype="bfloat16" if gpu else "float32",
                                        model_extra=model_extra, stage_extra=stage_extra,
                                        packing="false" if arm == "unpacked" else "true",
                                        quantizer='[quantizer]\nuse = "bnb-nf4"' if method == "qlora" else "",
                                        adapter=adapter, max_steps=args.steps, batch_size=batch_size,
                                        max_length=max_length, learning_rate=LEARNING_RATE))
            run_ftcore(plan)
        results[arm if arm in ("baseline", "ftcore") else f"ftcore+{arm}"] = \
            measure(recorder, args.warmup, method, peak_flops)
    shutil.rmtree(work, ignore_errors=True)  # the saved model: 16 GB for 8B
    return results


def table(results: dict[str, dict], peak_note: str) -> str:
    lines = ["| run | arm | real tokens/s | x baseline | peak memory GiB | x baseline | MFU | "
             "loss (mean of last 10) | max per-step loss diff |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, arms in results.items():
        b = arms["baseline"]
        for label, r in (("HF+TRL defaults", b), *((k, v) for k, v in arms.items() if k != "baseline")):
            if "skipped" in r:
                lines.append(f"| {name} | {label} | skipped: {r['skipped']} (unmeasured) | | | | | | |")
                continue
            diff = max((abs(x - y) for x, y in zip(b["losses"], r["losses"])), default=float("nan"))
            mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
            last = r["losses"][-10:]
            speed = r["tokens_per_s"] / b["tokens_per_s"]
            lines.append(f"| {name} | {label} | {r['tokens_per_s']:.0f} | {speed:.2f} | "
                         f"{r['peak_gib']:.2f} | {r['peak_gib'] / b['peak_gib']:.2f} | {mfu} | "
                         f"{sum(last) / len(last):.4f} | {diff:.4f} |")
    return "\n".join(lines) + f"\n\nMFU = tokens/s x (4N + 2N_trainable for LoRA/QLoRA, 6N for full) / {peak_note}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny config on CPU (or GPU), a few steps")
    parser.add_argument("--runs", help="comma-separated run names (default: all of the mode)")
    parser.add_argument("--steps", type=int, help="training steps per arm (default 50; tiny 8)")
    parser.add_argument("--warmup", type=int, help="untimed steps at the start (default 5; tiny 2)")
    parser.add_argument("--rows", type=int, help="synthetic rows (default: enough for the steps)")
    parser.add_argument("--peak-tflops", type=float, help="dense bf16 peak of the device, for MFU")
    parser.add_argument("--options", default="", help="comma-separated option arms after the ftcore arm, or "
                        f"'all': {', '.join(OPTIONS)}")
    parser.add_argument("--json", type=Path, help="also write the measurements here")
    parser.add_argument("--append-results", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    args.steps = args.steps or (8 if args.tiny else 50)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.tiny else 5)
    args.options = list(OPTIONS) if args.options == "all" else [o for o in args.options.split(",") if o]
    bad = [o for o in args.options if o not in OPTIONS]
    if bad:
        parser.error(f"unknown option arm(s) {', '.join(bad)}; there are {', '.join(OPTIONS)}")
    catalogue = TINY_RUNS if args.tiny else RUNS
    names = args.runs.split(",") if args.runs else list(catalogue)
    unknown = [n for n in names if n not in catalogue]
    if unknown:
        parser.error(f"unknown run(s) {', '.join(unknown)}; this mode has {', '.join(catalogue)}")

    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in device), None)
    if not torch.cuda.is_available() and not args.peak_tflops:
        peak = None
    if not args.tiny and not torch.cuda.is_available():
        sys.exit("gpu_throughput: no CUDA device; the 8B/1B runs need one (use --tiny on CPU)")
    results = {name: run_one(name, catalogue[name], args, peak * 1e12 if peak else None) for name in names}
    peak_note = f"{peak:g} TFLOP/s (dense bf16 of {device})" if peak else "no peak given on CPU: MFU n/a"
    out = table(results, peak_note)
    header = f"device: {device}; machine: {machine()}; {args.steps} steps per arm, {args.warmup} untimed"
    print(header)
    print()
    print(out)
    if args.json:
        args.json.write_text(json.dumps(results))
    if args.append_results:
        with (ROOT / "benchmarks" / "RESULTS.md").open("a", encoding="utf-8") as fh:
            fh.write(f"\n### gpu_throughput, {datetime.date.today()}\n\n{header}\n\n{out}\n")


if __name__ == "__main__":
    main()
