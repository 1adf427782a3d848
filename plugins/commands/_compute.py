"""``ftcore estimate --gpu``: training time and cost from the model's FLOPs, the data's tokens and a GPU.

    hours = tokens trained x FLOPs per token / (GPUs x peak FLOP/s x MFU) / 3600
    cost  = hours x GPUs x price per GPU-hour

- **FLOPs per token** (the usual accounting: Kaplan et al. 2020, PaLM's appendix B): a forward
  pass costs 2 FLOPs per parameter that multiplies (every weight but the input embedding
  lookup; a tied output head counts once; an adapter's own weights too), plus attention's
  ``A = 4 x layers x sequence x hidden``; backward costs twice the forward for the activations'
  gradients and, for trainable weights only, their gradients: ``6N + 3A`` for full fine-tuning,
  ``4N + 2N_trainable + 3A`` with an adapter (the frozen base gets no weight gradients; the
  first layer's input gradient, which nothing needs, is still counted). Gradient checkpointing
  runs the forward once more; DPO and KTO also run the reference model's forward. The sequence
  is the block length for ``pretrain`` and the mean sample length otherwise (padding and
  packing do not attend across samples).
- **Tokens per epoch**: the stage's rows tokenized as the trainer tokenizes them (template,
  max_length), from a sample of up to ``SAMPLE`` rows spread evenly over the data, scaled to
  all its rows; exact when the sample is the whole data. With ``max_steps``, the tokens trained
  are the steps' batches: ``max_steps x batch x accumulation x processes`` samples of the mean
  length.
- **Peak FLOP/s**: dense (no sparsity) bf16 tensor-core rates from the vendors' datasheets,
  overridable with ``--peak-flops``; ``cpu`` is this machine's fp32 matmul rate, measured.
- **MFU** (model FLOPs utilisation): the share of peak a training step achieves. 0.35 by
  default for GPUs, a middle value for LoRA and full fine-tuning with transformers and FSDP/ZeRO;
  1.0 for ``cpu``, whose rate is already the one measured. ``--mfu`` overrides it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

SAMPLE = 1_000  # rows tokenized to measure a data set's tokens per row
MFU = 0.35

# Peak dense bf16 tensor FLOP/s per GPU (vendor datasheets; fp16 with fp32 accumulate on GeForce cards).
PEAK_BF16 = {
    "b200": 2250e12,
    "h200": 989e12,
    "h100-sxm": 989e12,
    "h100-pcie": 756e12,
    "mi300x": 1307e12,
    "a100": 312e12,
    "l40s": 362e12,
    "a10": 125e12,
    "l4": 121e12,
    "rtx4090": 165e12,
    "rtx3090": 71e12,
}


@dataclass
class StageCompute:
    stage: str
    tokens_per_epoch: int | None  # None: a stream, whose length is unknown
    tokens_source: str
    tokens: int  # trained over the whole stage
    flops_per_token: float
    flops_formula: str
    hours: float
    cost: float | None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def cpu_flops(seconds: float = 1.0) -> float:
    """This machine's fp32 matmul rate (FLOP/s) on all the threads torch uses: the best of a few runs."""
    import torch

    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm up
    best, start = 0.0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        for _ in range(4):
            a @ b
        best = max(best, 4 * 2 * n**3 / (time.perf_counter() - t))
    return best


def peak_flops(gpu: str, override: float | None) -> tuple[float, str]:
    if override is not None:
        return override, "--peak-flops"
    if gpu == "cpu":
        rate = cpu_flops()
        return rate, "this machine's fp32 matmul rate, measured"
    return PEAK_BF16[gpu], "dense bf16, vendor datasheet"


def flops_per_token(base_params: int, trainable: int, *, full: bool, layers: int, hidden: int, seq_len: int,
                    checkpointing: bool, reference: bool) -> tuple[float, str]:
    """FLOPs to train one token, and the formula with its numbers. ``base_params``: the model's
    weights a token multiplies; ``trainable``: the trained ones (an adapter's own, or all)."""
    n = base_params if full else base_params + trainable  # an adapter's weights multiply too
    attention = 4 * layers * seq_len * hidden  # forward, per token: scores and weighted values (PaLM's count)
    total = 6 * n + 3 * attention if full else 4 * n + 2 * trainable + 3 * attention
    formula = "6N + 3A" if full else "4N + 2N_trainable + 3A"
    if checkpointing:
        total += 2 * n + attention
        formula += " + (2N + A) (checkpointing: one more forward)"
    if reference:
        total += 2 * base_params + attention
        formula += " + (2N_base + A) (the reference model's forward)"
    return float(total), (f"{formula}; N = {n:,}, N_trainable = {trainable:,}, A = attention = 4 x {layers} layers "
                          f"x {seq_len:,} x {hidden} = {attention:,}")


def sample_tokens(runner: Any, stage: Any, tokenizer: Any) -> tuple[int | None, str, float]:
    """Tokens per epoch of ``stage``'s training rows, how they were counted, and the mean per sample."""
    from ftcore_plugins.common.chat import chosen_as_chat, encode
    from ftcore_plugins.common.prepare import is_stream

    rows = runner._load_data(stage.data)
    if is_stream(rows):
        return None, "a stream: its length is unknown; set max_steps", 0.0
    total = len(rows)
    step = max(1, total // SAMPLE)
    sample = rows.select(range(0, total, step)[:SAMPLE])
    columns = set(sample.column_names)
    o = stage.trainer.options
    max_length = None if stage.trainer.name == "pretrain" else getattr(o, "max_length", None)
    if {"prompt", "chosen", "rejected"} <= columns:  # a pair: prompt + chosen and prompt + rejected
        counts = []
        for side in ("chosen", "rejected"):
            chat = chosen_as_chat(sample, side)
            _, stats = encode(chat, tokenizer, runner.template, max_length=max_length, train_on_inputs=True)
            counts.append(stats.tokens)
        tokens, samples = sum(counts), len(sample)
    elif {"prompt", "completion", "label"} <= columns and isinstance(sample[0]["prompt"], list):
        chat = sample.map(lambda r: {"messages": r["prompt"] + r["completion"]}, remove_columns=sample.column_names)
        _, stats = encode(chat, tokenizer, runner.template, max_length=max_length, train_on_inputs=True)
        tokens, samples = stats.tokens, len(sample)
    else:
        _, stats = encode(sample, tokenizer, runner.template, max_length=max_length,
                          train_on_inputs=bool(getattr(o, "train_on_inputs", False)), on_error="skip")
        tokens, samples = stats.tokens, max(stats.kept, 1)
    per_row = tokens / max(len(sample), 1)
    how = "all rows tokenized" if len(sample) == total else f"{len(sample):,} of {total:,} rows tokenized, scaled"
    return round(per_row * total), how, tokens / samples


def stage_compute(estimate: Any, runner: Any, stage: Any, tokenizer: Any, config: Any, *, peak: float, mfu: float,
                  gpus: int, price: float | None, compute_params: int) -> StageCompute:
    o = stage.trainer.options
    settings = estimate.settings
    per_epoch, how, mean = sample_tokens(runner, stage, tokenizer)
    max_steps = getattr(o, "max_steps", -1) or -1
    if max_steps > 0:
        samples = max_steps * settings.batch_size * getattr(o, "gradient_accumulation_steps", 1) * gpus
        packed = stage.trainer.name == "pretrain" or getattr(o, "packing", False)
        length = settings.seq_len if packed else min(mean or settings.seq_len, settings.seq_len)
        tokens = int(samples * length)
        how = f"max_steps {max_steps} x {samples // max_steps} samples x {length:,.0f} tokens ({how})"
    else:
        tokens = int((per_epoch or 0) * getattr(o, "epochs", 1.0))
        how = f"{getattr(o, 'epochs', 1.0):g} epoch(s) x tokens per epoch ({how})"
    text = getattr(config, "text_config", None) or config
    full = estimate.trainable_params >= 0.9 * estimate.total_params
    reference = stage.trainer.name in ("dpo", "kto") and not getattr(o, "reference_free", False)
    span = settings.seq_len if stage.trainer.name == "pretrain" or not mean else min(round(mean), settings.seq_len)
    fpt, formula = flops_per_token(compute_params, estimate.trainable_params, full=full,
                                   layers=text.num_hidden_layers, hidden=text.hidden_size, seq_len=span,
                                   checkpointing=settings.gradient_checkpointing, reference=reference)
    hours = tokens * fpt / (gpus * peak * mfu) / 3600
    return StageCompute(stage.name, per_epoch, how, tokens, fpt, formula, hours,
                        hours * gpus * price if price is not None else None)
