"""Training throughput, peak memory and MFU of ftcore's ``sft`` against plain HF + TRL defaults,
on models built from architecture configs (random init, nothing downloaded), side by side; each
arm's numbers written (JSON lines, and a line on stdout) as soon as the arm finishes.

    python benchmarks/gpu_throughput.py --quick --jsonl $OUT/gpu.jsonl   # GPU: fits one 8-minute command
    python benchmarks/gpu_throughput.py [--runs 8b-lora-2048,...] [--steps 50] [--options all] [--append-results]
    python benchmarks/gpu_throughput.py --tiny            # CPU: a tiny config, a few steps (what the tests run)
    python benchmarks/gpu_throughput.py --tiny --quick    # CPU: the quick preset's structure on tiny models

Runs (GPU): LoRA and QLoRA (nf4) of Llama-3-8B at sequence lengths 2048 and 8192, and full
fine-tuning of a Llama-3.2-1B-shaped model at 2048 (the default set); LoRA and QLoRA of the 1B
model at 2048 by name (``--runs``). Each architecture's random-init model is saved once (bf16 on a
GPU) with a tokenizer (Llama 3's from ../shared/fixtures when there, else a BPE trained here) and
kept until its last arm; every arm of a run trains it on the same synthetic rows (chat rows of
repeated words, lengths log-normal with median max_length/4, capped at max_length: real lengths,
not full-length rows).

Each arm, and each model build, runs in a process of its own: a fork of this one, which never
initialises CUDA (it tells whether there is a GPU through NVML; a probe child reads the device's
name) and imported the libraries every arm uses once (``PRELOAD``: torch, transformers' Trainer,
trl, peft, deepspeed, ftcore's runner and plugins). On a GPU it imports only as many of them as the
probe child found to leave CUDA uninitialised: bitsandbytes' import reads the devices' compute
capabilities, and peft imports bitsandbytes, and transformers' Trainer peft, so there each arm
imports those itself (seconds, in every arm's fixed part). So what one arm changes for the whole
process (Liger's patches of the Llama modules, torch.compile's and dynamo's caches, CUDA's
allocator and peak statistics) ends with it, and no arm measures another's leftovers. A child
sends its result back in a JSON file in the scratch folder; one that crashes (an exception, a
non-zero exit, a signal: the kernel's OOM killer) is that arm's ``error``, and the next arm goes
on; one still running when this process dies is killed with it (``PR_SET_PDEATHSIG``). Each arm's
line carries its process id (``pid``).

The arms:

* ``baseline``: ``SFTTrainer(model, args=SFTConfig(...), peft_config=LoraConfig(...))`` with TRL's
  defaults (bf16, gradient checkpointing, padded batches) and only what must be equal set: batch
  size, max_length, learning rate, steps, a log every step; it trains on the token ids ftcore prepared.
* ``baseline-packed``: the same with ``packing=True`` (TRL's bfd packing, which turns on its
  padding-free collator): the baseline that sees the same real tokens per step as ftcore's packing.
* ``ftcore``: ``ftcore run`` of a plan (``hf`` loader, ``lora`` adapter, ``nf4`` for QLoRA) with
  ftcore's defaults plus ``packing = true`` (best-fit, padding-free) and ``gradient_checkpointing = true``.
* ``ftcore+OPTION`` (``--options``): the ftcore arm with one option on top (``OPTIONS`` below:
  packed attention (flex, sdpa-block, per-sample, varlen), attention implementations, Liger,
  NEFTune, compile, loss kernels, optimizers, and packing off: ``unpacked``). An arm that needs CUDA
  (or a package that is not installed) is written as skipped, with the reason, so one command on a
  GPU measures them all: ``--options all``.

``--quick``: 1b-lora-2048, 1b-qlora-2048, 1b-full-2048 and 8b-qlora-2048, 11 steps per arm (8
timed), the arms baseline, baseline-packed, ftcore, ftcore+liger, ftcore+sdpa-block (ftcore+flex
where flash_attn is installed) and ftcore+unpacked (8B QLoRA: the first three only), and a deadline
of 450 s. The attention arm is the packed-attention path ftcore does not take by default on CUDA:
its default is the first of varlen (flash_attn installed), flex, sdpa_block
(``ftcore_plugins.common.device_defaults.CUDA``), so without flash_attn the ftcore arm already
measures flex and sdpa-block is the alternative; with it, ftcore measures varlen and flex is. The
work is ordered by importance: baseline and ftcore of every run first, then baseline-packed of every
run, then the option arms (``--options`` replaces the quick option arms; ``--runs`` its runs).
``--tiny --quick`` is the same structure on tiny models (a 2-layer one for the 1B runs, a 4-layer
one for the 8B run) on a CPU, where the CUDA arms are written as skipped.

Deadline (``--deadline-s``, counted from the script's start). Each arm has a budget, the seconds it
is expected to take, from its own size:

    budget = fixed + weight bytes / LOAD_BYTES_PER_S (1 GB/s)
             + steps x batch size x max_length x FLOPs per token / rate

FLOPs per token as for MFU below (6N full, 4N + 2N_trainable LoRA and QLoRA, from the
architecture); weight bytes: the parameters at 2 bytes (bf16, GPU) or 4 (fp32, CPU), read back,
moved to the device and quantized; rate: on a GPU ``ASSUMED_MFU`` (35%) of its dense bf16 peak
(``UNKNOWN_GPU_FLOPS`` where that is unknown; a small model's measured rate is held down by costs
that do not grow with the model, kernel compiles and launches, so it is not scaled up); on a CPU
the lowest rate measured so far (the arm's method first: training FLOPs over ``train_seconds``),
else ``CPU_FLOPS``; fixed: the largest residual of the arms measured so far (an arm's seconds less
its load and training terms: process, imports, CUDA context, stage setup, data preparation, JIT),
else ``FIXED_S``. Once an arm of the same run has been measured, the budget is instead the slowest
such arm's seconds. A model build's budget is ``BUILD_FIXED_S`` (or the largest measured residual
of a build) + weight bytes / ``SAVE_BYTES_PER_S`` (0.5 GB/s). Before an arm starts: if the time
gone + its budget (+ its model's build, when not built yet) would pass the deadline, it is written
as skipped (``deadline: ...``, with ``estimate_s`` and ``estimate_from``, how it was made) and
never started; only such arms are "skipped" for the deadline. An arm (or build) that started is
killed at the deadline, not at a multiple of its budget (a budget is a guess; an arm over it that
ends in time is still a measurement), and is then written as an error, ``timed out after N s``.
Without a deadline nothing is killed.

JSON lines (``--jsonl``, default a new file in the temp folder; its path is printed first), each
flushed when written, each with ``event`` and ``t`` (seconds since the start):

* ``start``: device, machine, argv, ``pid`` (this process's), steps, warm-up, deadline, the
  ``schedule`` ([run, arm, budget_s] in order: each arm's a-priori budget, nothing measured yet, its
  model's build not included), ``build_budgets_s`` (architecture: a-priori budget of its build), and
  ``scratch``: the temporary folder of the models and runs, removed at exit (a killed run leaves it).
* ``build``: an architecture's model built and saved (``seconds``), or its ``error``; ``pid``, ``budget_s``.
* ``prepare``: a run's rows and token ids (``seconds``).
* ``arm``: ``run``, ``arm``, ``budget_s`` and ``budget_from`` (its budget when it was reached, and
  how it was made), and either the measurements (below) and ``pid``, or ``skipped`` (the reason;
  ``estimate_s`` and ``estimate_from`` for a deadline: no process was started), or ``error`` and
  ``pid`` (the exception in the arm's process, e.g. an OOM, or its exit status or signal, or
  ``timed out after N s``: the script goes on to the next arm).
* ``pair``: as soon as an arm and the baseline arm that saw the same real tokens per step are both
  measured: ``arm``, ``reference`` (``baseline-packed`` for packed arms, ``baseline`` for the
  unpacked ones), ``x_memory`` (peak against the reference's), ``same_tokens_per_step`` (every
  step's real tokens equal), ``tokens_per_step_ratio`` (mean real tokens per step against the
  reference's), ``x_tokens_per_s`` (against ``baseline``), ``max_loss_diff`` (per step).
* ``end``: ``seconds`` in all.

Measured per arm, in its own process: real (non-padding) tokens/s over the timed steps (a callback
counts the tokens each forward saw), peak memory (``torch.cuda.max_memory_allocated``; on CPU the
arm's process's own peak RSS from ``ftcore.memory``, its high-water mark reset as the arm starts;
the libraries' pages it shares with this process count in it, as in every arm), MFU = FLOPs/s /
peak, with FLOPs per token 4*N + 2*N_trainable (LoRA, QLoRA) or 6*N (full), N = the parameters used
in matmuls (all but the input embedding, the LM head counted once), attention FLOPs left out, peak =
the GPU's dense bf16 peak (``--peak-tflops``; MFU is "n/a" on CPU unless given, and the table says
so); ``seconds`` (the whole arm, from the fork to its process's exit: model load, preparation,
training), ``train_seconds``, and for ftcore arms ``chosen``: the paths the stage chose for itself
(``packed_attention``, ``loss_kernel``, as its metrics log them; shown beside the arm's name: on a
GPU ftcore's defaults may already be an option arm's path). Packed bins padded to one row each
(flex, sdpa_block) count their padding as positions, not real tokens.

At the end, the table (stdout; ``--append-results`` appends it to benchmarks/RESULTS.md, the only
file written in the repository): tokens/s against HF+TRL defaults (``baseline``, what a user would
otherwise run); peak memory against the baseline arm with the same real tokens per step (named in
the table, with whether the tokens were in fact equal); loss: the mean of the last 10 per-step
losses, and the largest per-step difference from that same reference. Models, runs and the data
cache live in a temporary folder, removed at exit.
"""

from __future__ import annotations

import time

START = time.monotonic()  # the deadline counts from here, imports included

import argparse  # noqa: E402
import atexit  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench  # noqa: E402
from _bench import HF_SFT_PLAN, PRELOAD, ROOT, SHARED, error_text, in_child, machine, preload, probe, \
    quiet, run_ftcore  # noqa: E402

ARCHITECTURES = {  # transformers LlamaConfig fields
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192,
               tie_word_embeddings=False),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192,
               tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=256, vocab_size=512, max_position_embeddings=256, tie_word_embeddings=True),
    "tiny4": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=512, vocab_size=512, max_position_embeddings=256, tie_word_embeddings=False),
}
# name: (architecture, method, max_length, batch size): about 16k positions per step on the GPU
RUNS = {
    "8b-lora-2048": ("8b", "lora", 2048, 8),
    "8b-lora-8192": ("8b", "lora", 8192, 2),
    "8b-qlora-2048": ("8b", "qlora", 2048, 8),
    "8b-qlora-8192": ("8b", "qlora", 8192, 2),
    "1b-full-2048": ("1b", "full", 2048, 8),
    "1b-lora-2048": ("1b", "lora", 2048, 8),
    "1b-qlora-2048": ("1b", "qlora", 2048, 8),
}
DEFAULT_RUNS = ["8b-lora-2048", "8b-lora-8192", "8b-qlora-2048", "8b-qlora-8192", "1b-full-2048"]
TINY_RUNS = {"tiny-lora-128": ("tiny", "lora", 128, 4), "tiny-qlora-128": ("tiny", "qlora", 128, 4),
             "tiny-full-128": ("tiny", "full", 128, 4), "tiny4-qlora-128": ("tiny4", "qlora", 128, 4)}
DEFAULT_TINY_RUNS = ["tiny-lora-128", "tiny-qlora-128", "tiny-full-128"]
# --quick: (run, the tiny run that stands for it with --tiny, whether its option arms are kept)
QUICK = [("1b-lora-2048", "tiny-lora-128", True), ("1b-qlora-2048", "tiny-qlora-128", True),
         ("1b-full-2048", "tiny-full-128", True), ("8b-qlora-2048", "tiny4-qlora-128", False)]
QUICK_STEPS, QUICK_WARMUP, QUICK_DEADLINE_S = 11, 2, 450.0  # 8 timed steps (the last step is not timed)
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}  # dense bf16
# Budgets (the docstring's Deadline): what is assumed until this process has measured better.
ASSUMED_MFU = 0.35  # of the GPU's dense bf16 peak: training FLOPs (gradient checkpointing's recompute not counted)
UNKNOWN_GPU_FLOPS = 35e12  # achieved, on a GPU not in PEAK_TFLOPS without --peak-tflops (35% of ~100 TFLOP/s)
CPU_FLOPS = 1e9  # achieved fp32 FLOP/s on a CPU before an arm has been measured (tiny models: mostly overhead)
FIXED_S = {True: 30.0, False: 10.0}  # GPU, CPU: an arm's process, CUDA context, stage setup, data, first JIT
BUILD_FIXED_S = {True: 20.0, False: 10.0}  # a build's process, tokenizer, random init
LOAD_BYTES_PER_S = 1e9  # weights read back from the page cache, moved to the device, quantized (QLoRA)
SAVE_BYTES_PER_S = 0.5e9  # a build's weights written (the 8B save took 22 s on an H200: 0.73 GB/s)
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0)
LEARNING_RATE = 2e-4
BASELINES = ("baseline", "baseline-packed")
TIER = {"baseline": 0, "ftcore": 0, "baseline-packed": 1}  # the rest (option arms): 2



@dataclasses.dataclass(frozen=True)
class Option:
    """An ftcore arm with one option on top of its defaults."""

    model: str = ""  # [model] lines
    stage: str = ""  # [[stage]] lines
    cuda: bool = False  # skipped without CUDA
    package: str | None = None  # skipped when this module is not importable
    packed: bool = True  # False: packing = false (its equal-token reference is then the padded baseline)


OPTIONS = {
    "flex": Option(stage='packed_attention = "flex"', cuda=True),  # compiles slowly on a CPU
    "sdpa-block": Option(stage='packed_attention = "sdpa_block"'),
    "per-sample": Option(stage='packed_attention = "sdpa_per_sample"'),
    "varlen": Option(stage='packed_attention = "varlen"', cuda=True, package="flash_attn"),
    "sdpa": Option(model='attn_implementation = "sdpa"'),
    "eager": Option(model='attn_implementation = "eager"'),
    "flash-attention-2": Option(model='attn_implementation = "flash_attention_2"', cuda=True, package="flash_attn"),
    "flash-attention-3": Option(model='attn_implementation = "flash_attention_3"', cuda=True),
    "flex-attention": Option(model='attn_implementation = "flex_attention"', cuda=True),
    "liger": Option(stage="liger = true", cuda=True, package="liger_kernel"),
    "neftune": Option(stage="neftune_noise_alpha = 5.0"),
    "compile": Option(stage="compile = true"),
    "unpacked": Option(packed=False),  # what packing (per-sample attention, or varlen flash) buys
    "loss-chunked": Option(stage='loss_kernel = "chunked"'),
    "loss-full": Option(stage='loss_kernel = "full"'),
    "loss-trl": Option(stage='loss_kernel = "trl"'),
    "adamw-fused": Option(stage='optimizer = "adamw_torch_fused"'),
    "adamw-8bit": Option(stage='optimizer = "adamw_8bit"'),
    "paged-adamw-8bit": Option(stage='optimizer = "paged_adamw_8bit"'),
    "adafactor": Option(stage='optimizer = "adafactor"'),
    "lion-8bit": Option(stage='optimizer = "lion_8bit"'),
}


def option_of(arm: str) -> Option | None:
    return OPTIONS[arm.removeprefix("ftcore+")] if arm.startswith("ftcore+") else None


def packed(arm: str) -> bool:
    if arm in BASELINES:
        return arm == "baseline-packed"
    option = option_of(arm)
    return option.packed if option else True


def reference(arm: str) -> str:
    """The baseline arm that sees the same real tokens per step: the packed one for packed arms."""
    return "baseline-packed" if packed(arm) else "baseline"


def unavailable(arm: str, gpu: bool) -> str | None:
    option = option_of(arm)
    if option is None:
        return None
    if option.cuda and not gpu:
        return "needs CUDA"
    if option.package and importlib.util.find_spec(option.package) is None:
        return f"needs the {option.package} package, which is not installed here"
    return None


def parameters(arch: str, *, matmul: bool = False) -> int:
    """The architecture's parameter count (its weights' bytes, for budgets); ``matmul``: those used in
    matmuls, as ``matmul_params`` counts a loaded model (the input embedding left out, a tied LM head
    counted once). Norms left out."""
    c = ARCHITECTURES[arch]
    h, kv = c["hidden_size"], c["hidden_size"] * c["num_key_value_heads"] // c["num_attention_heads"]
    layer = h * (2 * h + 2 * kv) + 3 * h * c["intermediate_size"]
    embeddings = 1 if c["tie_word_embeddings"] or matmul else 2
    return c["num_hidden_layers"] * layer + c["vocab_size"] * h * embeddings


def trainable_parameters(arch: str, method: str) -> int:
    """What trains: every weight (full), else LoRA's A and B (rank ``LORA["r"]``) on each linear layer of
    the blocks: q and o (h to h), k and v (h to kv), gate, up and down (h and the MLP's width)."""
    if method == "full":
        return parameters(arch)
    c = ARCHITECTURES[arch]
    h, kv = c["hidden_size"], c["hidden_size"] * c["num_key_value_heads"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * LORA["r"] * (9 * h + 2 * kv + 3 * c["intermediate_size"])


def flops_per_token(arch: str, method: str) -> int:
    """Training FLOPs per position, as MFU counts them: 6N (full), 4N + 2N_trainable (LoRA, QLoRA)."""
    n = parameters(arch, matmul=True)
    return 6 * n if method == "full" else 4 * n + 2 * trainable_parameters(arch, method)


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

    if not arch.startswith("tiny") and (SHARED / "tokenizers" / "llama3").exists():
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


def reset_peaks() -> None:
    """This process's peaks from here: CUDA's statistics, and the RSS high-water mark (a fork starts
    with its own on Linux; reset anyway, so that an arm's peak is its own on any kernel)."""
    import torch

    from ftcore import memory

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    memory.reset_peak()


def peak_memory_gib() -> float:
    import torch

    from ftcore import memory

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return memory.snapshot()["peak_rss_mib"] / 1024


class ProbeCounts:
    """What ModelProbe adds to _bench's StepRecorder: the trained model's parameter counts, and the
    padding of packed bins (``packed_attention`` flex and sdpa_block: one row per bin, right-padded,
    no attention mask) not counted as real tokens."""

    pad_token_id: int | None = None  # the tokenizer's, set before each arm

    def on_train_begin(self, args, state, control, model=None, **kw):
        super().on_train_begin(args, state, control, model=model, **kw)
        self.n_matmul = matmul_params(model)
        self.n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)

    def _count(self, module, args, kwargs):
        super()._count(module, args, kwargs)
        ids, labels = kwargs.get("input_ids"), kwargs.get("labels")
        if (self.real and kwargs.get("attention_mask") is None and kwargs.get("position_ids") is not None
                and self.pad_token_id is not None and ids is not None and labels is not None and ids.dim() == 2):
            self.real[-1] -= bin_padding(ids, labels, self.pad_token_id)


def model_probe() -> Any:
    """A ModelProbe (ProbeCounts on StepRecorder, a transformers callback), installed in every Trainer
    built from now on. Made in the arm's process: transformers' callbacks import peft, and so
    bitsandbytes, whose import initialises CUDA on a GPU, which this process must not."""
    cls = type("ModelProbe", (ProbeCounts, _bench.StepRecorder), {"__doc__": ProbeCounts.__doc__})
    return cls().install()


def bin_padding(ids, labels, pad_token_id: int) -> int:
    """The padding positions of a batch of right-padded packed bins without an attention mask: each
    row's trailing run of pad tokens that are not trained. A real sample never ends so: its last token
    (the turn's end, or a truncated response's last) is trained."""
    untrained_pad = (ids == pad_token_id) & (labels == -100)
    return int(untrained_pad.flip(1).long().cumprod(1).sum())


@dataclasses.dataclass
class Run:
    name: str
    arch: str
    method: str
    max_length: int
    batch_size: int
    arms: list[str]
    work: Path
    rows: Path | None = None
    token_ids: Any = None
    results: dict[str, dict] = dataclasses.field(default_factory=dict)


def baseline_arm(run: Run, folder: Path, tokenizer, args, dtype, *, packing: bool) -> None:
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    from trl import SFTConfig, SFTTrainer

    kwargs = {}
    if run.method == "qlora":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16)
        if torch.cuda.is_available():
            kwargs["device_map"] = {"": 0}  # 4-bit weights are placed at load; the Trainer cannot move them
    name = "baseline-packed" if packing else "baseline"
    cpu = {} if torch.cuda.is_available() else {"bf16": False}  # TRL's default bf16 refuses a CPU
    with quiet():  # the model load's progress bar, the configs' deprecation warnings, the Trainer's prints
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs)  # the Trainer moves it to the GPU
        config = SFTConfig(output_dir=str(run.work / name), max_steps=args.steps,
                           per_device_train_batch_size=run.batch_size, max_length=run.max_length,
                           learning_rate=LEARNING_RATE, logging_steps=1, save_strategy="no", report_to="none",
                           seed=7, **({"packing": True} if packing else {}), **cpu)
        peft = None if run.method == "full" else LoraConfig(task_type="CAUSAL_LM", target_modules="all-linear", **LORA)
        SFTTrainer(model=model, args=config, train_dataset=run.token_ids, processing_class=tokenizer,
                   peft_config=peft).train()


def ftcore_arm(run: Run, arm: str, folder: Path, args, gpu: bool) -> dict[str, str]:
    option = option_of(arm) or Option()
    adapter = '"full"' if run.method == "full" else \
        "{{ use = \"lora\", r = {r}, lora_alpha = {lora_alpha}, lora_dropout = {lora_dropout} }}".format(**LORA)
    plan = run.work / f"{arm.replace('+', '-')}.toml"
    plan.write_text(HF_SFT_PLAN.format(
        name=arm.replace("+", "-"), model=folder, dtype="bfloat16" if gpu else "float32", model_extra=option.model,
        stage_extra="gradient_checkpointing = true\n" + option.stage, rows=run.rows,
        packing="true" if option.packed else "false",
        quantizer='[quantizer]\nuse = "bnb-nf4"' if run.method == "qlora" else "", adapter=adapter,
        max_steps=args.steps, batch_size=run.batch_size, max_length=run.max_length, learning_rate=LEARNING_RATE))
    return resolved(Path(run_ftcore(plan)["run_dir"]) / "metrics.jsonl")


def resolved(metrics: Path) -> dict[str, str]:
    """What the sft stage chose for itself, logged at step 0 (``loss_kernel``, ``packed_attention``)."""
    chosen = {}
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        row = json.loads(line)
        if row.get("stage") == "sft" and row.get("step") == 0:
            chosen.update({k: v for k, v in row.items() if isinstance(v, str) and k != "stage"})
    return chosen


def measure(recorder: Any, warmup: int, method: str, peak_flops: float | None) -> dict:
    seconds = recorder.step_seconds(warmup)
    if not seconds:
        raise RuntimeError(f"{len(recorder.begins)} training steps recorded: none to time after {warmup} warm-up "
                           "steps (the last step is not timed)")
    tokens = sum(recorder.real[warmup:warmup + len(seconds)])
    rate = tokens / sum(seconds)
    n, trainable = recorder.n_matmul, recorder.n_trainable
    flops_per_token = 6 * n if method == "full" else 4 * n + 2 * trainable
    losses = [recorder.losses[k] for k in sorted(recorder.losses)]
    return {"tokens_per_s": rate, "timed_tokens": tokens, "timed_steps": len(seconds),
            "tokens_per_step": list(recorder.real), "positions_per_step": list(recorder.total),
            "peak_gib": peak_memory_gib(), "n_matmul": n, "n_trainable": trainable,
            "mfu": rate * flops_per_token / peak_flops if peak_flops else None, "losses": losses,
            "train_seconds": (recorder.end or recorder.begins[-1]) - recorder.begins[0]}


def measured(result: dict | None) -> bool:
    return bool(result) and "tokens_per_s" in result


def compare(results: dict[str, dict], arm: str) -> dict | None:
    """``arm`` against the baseline arm that saw the same real tokens per step, once both are measured."""
    ref = reference(arm)
    r, b, base = results.get(arm), results.get(ref), results.get("baseline")
    if arm == ref or not (measured(r) and measured(b)):
        return None
    mean = sum(r["tokens_per_step"]) / len(r["tokens_per_step"])
    mean_ref = sum(b["tokens_per_step"]) / len(b["tokens_per_step"])
    return {"arm": arm, "reference": ref, "x_memory": r["peak_gib"] / b["peak_gib"],
            "same_tokens_per_step": r["tokens_per_step"] == b["tokens_per_step"],
            "tokens_per_step_ratio": mean / mean_ref,
            "max_tokens_per_step": [max(r["tokens_per_step"]), max(b["tokens_per_step"])],
            "x_tokens_per_s": r["tokens_per_s"] / base["tokens_per_s"] if measured(base) else None,
            "max_loss_diff": max((abs(x - y) for x, y in zip(r["losses"], b["losses"])), default=None)}


class Lines:
    """The JSON lines file: a line per event, flushed (and synced) as it is written."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.fh = open(path, "w", encoding="utf-8")  # noqa: SIM115 (open for the whole run)

    def write(self, event: str, **fields: Any) -> dict:
        line = {"event": event, "t": round(time.monotonic() - START, 2), **fields}
        self.fh.write(json.dumps(line) + "\n")
        self.fh.flush()
        os.fsync(self.fh.fileno())
        return line


def say(text: str) -> None:
    print(f"[{time.monotonic() - START:6.1f}s] {text}", flush=True)


def secs(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"


def achieved_flops(run: Run, result: dict) -> float:
    """A measured arm's training FLOP/s: every position it trained on, at ``flops_per_token``, over its
    ``train_seconds`` (the first steps' JIT included)."""
    return sum(result["positions_per_step"]) * flops_per_token(run.arch, run.method) / result["train_seconds"]


class Clock:
    """The deadline, and the budget of each arm and model build: the seconds it is expected to take, from
    its own size and what this process measured so far (the docstring's Deadline gives the formula)."""

    def __init__(self, deadline: float | None, runs: dict[str, Run], steps: int, gpu: bool,
                 peak_flops: float | None):
        self.deadline, self.runs, self.steps, self.gpu = deadline, runs, steps, gpu
        self.peak_flops = peak_flops if gpu else None  # a CPU's rate is measured, not a share of a peak
        self.arms: list[tuple[str, str, dict]] = []  # (run, arm, result) of every measured arm
        self.builds: list[tuple[str, float]] = []  # (arch, seconds) of every model built

    @staticmethod
    def elapsed() -> float:
        return time.monotonic() - START

    def weight_bytes(self, arch: str) -> int:
        return parameters(arch) * (2 if self.gpu else 4)  # bf16 on a GPU, fp32 on a CPU

    def training_flops(self, run: Run) -> float:
        """Every step's rows full: steps x batch size x max_length positions."""
        return self.steps * run.batch_size * run.max_length * flops_per_token(run.arch, run.method)

    def rate(self, method: str) -> tuple[float, str]:
        """Achieved training FLOP/s: on a GPU a share of its peak; on a CPU the lowest measured so far
        (an arm of the same method first), else a constant."""
        if not self.gpu:
            for same in (True, False):
                rates = [(achieved_flops(self.runs[name], r), f"{name} {arm}") for name, arm, r in self.arms
                         if not same or self.runs[name].method == method]
                if rates:
                    rate, where = min(rates)
                    return rate, f"measured, {where}"
            return CPU_FLOPS, "assumed for a CPU"
        if self.peak_flops:
            return ASSUMED_MFU * self.peak_flops, f"assumed, {ASSUMED_MFU:.0%} of {self.peak_flops / 1e12:g} TFLOP/s"
        return UNKNOWN_GPU_FLOPS, "assumed for a GPU of unknown peak"

    def fixed(self) -> tuple[float, str]:
        """What an arm takes besides loading and training: the largest residual measured so far (its
        training term from the positions it did train on, at the rate a budget would use)."""
        residuals = []
        for name, arm, r in self.arms:
            run = self.runs[name]
            trained = sum(r["positions_per_step"]) * flops_per_token(run.arch, run.method)
            predicted = self.weight_bytes(run.arch) / LOAD_BYTES_PER_S + trained / self.rate(run.method)[0]
            residuals.append((r["seconds"] - predicted, f"{name} {arm}"))
        if not residuals:
            return FIXED_S[self.gpu], "assumed"
        seconds, where = max(residuals)
        return max(0.0, seconds), f"measured, {where}"

    def arm_budget(self, run: Run) -> tuple[float, str]:
        """An arm's budget of ``run``, and how it was made."""
        same = [(r["seconds"], arm) for name, arm, r in self.arms if name == run.name]
        if same:
            seconds, arm = max(same)
            return seconds, f"the slowest {run.name} arm so far, {arm}"
        fixed, fixed_from = self.fixed()
        weights = self.weight_bytes(run.arch)
        load = weights / LOAD_BYTES_PER_S
        rate, rate_from = self.rate(run.method)
        train = self.training_flops(run) / rate
        return fixed + load + train, (
            f"fixed {secs(fixed)} ({fixed_from}) + load {secs(load)} ({weights / 1e9:.3g} GB at "
            f"{LOAD_BYTES_PER_S / 1e9:g} GB/s) + training {secs(train)} ({self.steps} steps x {run.batch_size} x "
            f"{run.max_length} positions x {flops_per_token(run.arch, run.method):.3g} FLOP at {rate:.3g} FLOP/s, "
            f"{rate_from})")

    def build_budget(self, arch: str) -> tuple[float, str]:
        """A model build's budget, and how it was made."""
        weights = self.weight_bytes(arch)
        save = weights / SAVE_BYTES_PER_S
        residuals = [(s - self.weight_bytes(a) / SAVE_BYTES_PER_S, a) for a, s in self.builds]
        if residuals:
            fixed, where = max(residuals)
            fixed, fixed_from = max(0.0, fixed), f"measured, the {where} build"
        else:
            fixed, fixed_from = BUILD_FIXED_S[self.gpu], "assumed"
        return fixed + save, (f"fixed {secs(fixed)} ({fixed_from}) + save {secs(save)} ({weights / 1e9:.3g} GB at "
                              f"{SAVE_BYTES_PER_S / 1e9:g} GB/s)")

    def late(self, seconds: float) -> bool:
        """Whether work of ``seconds`` started now would end past the deadline."""
        return self.deadline is not None and self.elapsed() + seconds > self.deadline

    def left(self) -> float | None:
        """The seconds to the deadline (None: no deadline), the most a started arm may run."""
        return None if self.deadline is None else max(0.0, self.deadline - self.elapsed())


def build_model(folder: Path, arch: str, rows: int, max_length: int, dtype) -> dict:
    """A model build, in a process of its own (the random init may run on the GPU): the tokenizer,
    trained on the first run's rows, and the model, saved to ``folder``."""
    tokenizer = tokenizer_for(arch, synthetic_rows(rows, max_length))
    with quiet():
        save_random_model(folder, arch, tokenizer, dtype)
    return {}


def train_arm(run: Run, arm: str, folder: Path, tokenizer, args, dtype, gpu: bool, peak_flops: float | None) -> dict:
    """An arm, in a process of its own: its measurements, or its error (where an OOM left the peak)."""
    reset_peaks()
    recorder = model_probe()
    recorder.pad_token_id = tokenizer.pad_token_id
    try:
        chosen = {}
        if arm in BASELINES:
            baseline_arm(run, folder, tokenizer, args, dtype, packing=arm == "baseline-packed")
        else:
            chosen = ftcore_arm(run, arm, folder, args, gpu)
        return {**measure(recorder, args.warmup, run.method, peak_flops), "chosen": chosen}
    except Exception as exc:  # noqa: BLE001 (an OOM or a failed arm is recorded; the next arm goes on)
        return {"error": error_text(exc), "peak_gib": peak_memory_gib()}


def bench(runs: dict[str, Run], schedule: list[tuple[str, str]], args, lines: Lines, peak_flops: float | None,
          gpu: bool, clock: Clock) -> None:
    import datasets
    import torch
    from transformers import AutoTokenizer

    from ftcore_plugins.common.prepare import prepare
    from ftcore_plugins.templates.chatml import ChatMLTemplate

    dtype = torch.bfloat16 if gpu else torch.float32
    models: dict[str, tuple[Path, Any]] = {}  # arch -> (saved model folder, tokenizer)
    broken: dict[str, str] = {}  # arch -> why its model could not be built
    left = {arch: sum(runs[r].arch == arch for r, _ in schedule) for arch in {runs[r].arch for r, _ in schedule}}

    def skip(run: Run, arm: str, reason: str, **extra: Any) -> None:
        run.results[arm] = {"skipped": reason, **extra}
        lines.write("arm", run=run.name, arm=arm, skipped=reason, **extra)
        say(f"{run.name} {arm}: skipped: {reason}")

    def too_late(run: Run, arm: str, seconds: float, source: str, budget: dict) -> bool:
        """Written as skipped for the deadline, never started, where ``seconds`` from now would pass it."""
        if not clock.late(seconds):
            return False
        skip(run, arm, f"deadline: {clock.elapsed():.0f} s gone, {seconds:.0f} s budgeted, "
             f"{args.deadline_s:g} s deadline", estimate_s=round(seconds, 1), estimate_from=source, **budget)
        return True

    for name, arm in schedule:
        run = runs[name]
        try:
            seconds, source = clock.arm_budget(run)
            budget = {"budget_s": round(seconds, 1), "budget_from": source}
            why = unavailable(arm, gpu)
            if why:
                skip(run, arm, why, **budget)
                continue
            if run.arch in broken:
                skip(run, arm, f"the {run.arch} model could not be built: {broken[run.arch]}", **budget)
                continue
            if run.arch not in models:
                build, build_from = clock.build_budget(run.arch)
                if too_late(run, arm, seconds + build,
                            f"{source}; the {run.arch} model's build first: {build:.0f} s, {build_from}", budget):
                    continue
                folder = args.scratch / f"model-{run.arch}"
                rows = args.rows or run.batch_size * (args.steps + 2) * 4
                result, pid, took = in_child(
                    lambda: build_model(folder, run.arch, rows, run.max_length, dtype),  # noqa: B023 (called now)
                    args.scratch / f"build-{run.arch}.json", clock.left(),
                    lambda pid: say(f"model {run.arch}: building (process {pid}, budget {build:.0f} s: {build_from})"),
                    limit_name="the deadline")
                if "error" in result:
                    broken[run.arch] = result["error"]
                    lines.write("build", arch=run.arch, pid=pid, budget_s=round(build, 1), seconds=took,
                                error=broken[run.arch])
                    say(f"model {run.arch}: failed after {took:.1f} s (process {pid}): {broken[run.arch]}")
                    skip(run, arm, f"the {run.arch} model could not be built: {broken[run.arch]}", **budget)
                    continue
                models[run.arch] = (folder, AutoTokenizer.from_pretrained(folder))
                clock.builds.append((run.arch, took))
                lines.write("build", arch=run.arch, pid=pid, budget_s=round(build, 1), seconds=took,
                            parameters=parameters(run.arch))
                say(f"model {run.arch} built and saved in {took:.1f} s (process {pid})")
            folder, tokenizer = models[run.arch]
            if run.token_ids is None:
                begin = time.monotonic()
                rows = synthetic_rows(args.rows or run.batch_size * (args.steps + 2) * 4, run.max_length)
                run.rows = run.work / "rows.jsonl"
                run.rows.write_text("".join(json.dumps(r) + "\n" for r in rows))
                run.token_ids = prepare(datasets.Dataset.from_list(rows), tokenizer, ChatMLTemplate(),
                                        max_length=run.max_length).dataset
                lines.write("prepare", run=run.name, rows=len(rows), seconds=time.monotonic() - begin)
            if too_late(run, arm, seconds, source, budget):  # the build and the data took their time
                continue
            result, pid, took = in_child(
                lambda: train_arm(run, arm, folder, tokenizer, args, dtype, gpu, peak_flops),  # noqa: B023
                run.work / f"{arm.replace('+', '-')}.json", clock.left(),
                lambda pid: say(f"{run.name} {arm}: starting (process {pid}, budget {seconds:.0f} s: {source})"),
                limit_name="the deadline")
            result.update(seconds=took, pid=pid, **budget)
            run.results[arm] = result
            if "error" in result:
                lines.write("arm", run=run.name, arm=arm, **result)
                say(f"{run.name} {arm}: failed after {took:.1f} s (process {pid}): {result['error']}")
                continue
            clock.arms.append((run.name, arm, result))
            lines.write("arm", run=run.name, arm=arm, arch=run.arch, method=run.method, max_length=run.max_length,
                        batch_size=run.batch_size, memory_vs=reference(arm), **result)
            say(arm_line(run, arm))
            for other in run.arms:  # the equal-token comparisons this arm completes
                if other == arm or reference(other) == arm:
                    pair = compare(run.results, other)
                    if pair:
                        run.results[other]["equal_work"] = pair
                        lines.write("pair", run=run.name, **pair)
                        say(pair_line(run, pair))
        except Exception as exc:  # noqa: BLE001 (preparing the run's data failed: this arm is lost, not the rest)
            if arm not in run.results:
                run.results[arm] = {"error": error_text(exc)}
                lines.write("arm", run=run.name, arm=arm, **run.results[arm])
                say(f"{run.name} {arm}: failed: {run.results[arm]['error']}")
        finally:
            left[run.arch] -= 1
            if left[run.arch] == 0 and run.arch in models:
                shutil.rmtree(models.pop(run.arch)[0], ignore_errors=True)  # 16 GB for 8B



def arm_line(run: Run, arm: str) -> str:
    r, base = run.results[arm], run.results.get("baseline")
    speed = f" ({r['tokens_per_s'] / base['tokens_per_s']:.2f}x HF+TRL defaults)" \
        if measured(base) and arm != "baseline" else ""
    mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
    return (f"{run.name} {label(arm, r)}: {r['tokens_per_s']:.0f} real tokens/s{speed}, peak {r['peak_gib']:.2f} GiB, "
            f"MFU {mfu}, {r['seconds']:.1f} s ({r['train_seconds']:.1f} s training; budget {r['budget_s']:.0f} s) "
            f"(process {r['pid']})")


def label(arm: str, result: dict) -> str:
    """The arm's name, with the paths ftcore chose for itself (``packed_attention``, ``loss_kernel``)."""
    name = {"baseline": "HF+TRL defaults", "baseline-packed": "HF+TRL packing=True"}.get(arm, arm)
    chosen = ", ".join(f"{k} {v}" for k, v in sorted(result.get("chosen", {}).items()))
    return f"{name} ({chosen})" if chosen else name


def pair_line(run: Run, pair: dict) -> str:
    same = "yes" if pair["same_tokens_per_step"] else f"no (mean {pair['tokens_per_step_ratio']:.3f}x)"
    return (f"{run.name} {pair['arm']} vs {pair['reference']} (same real tokens per step: {same}): "
            f"peak memory {pair['x_memory']:.2f}x")


def table(runs: dict[str, Run], peak_note: str) -> str:
    lines = ["| run | arm | real tokens/s | x HF+TRL defaults | peak memory GiB | x memory | memory vs "
             "(same real tokens) | same real tokens/step | MFU | loss (mean of last 10) | max per-step loss diff "
             "(vs the same) | arm s |", "|---|---|---:|---:|---:|---:|---|---|---:|---:|---:|---:|"]
    for run in runs.values():
        base = run.results.get("baseline")
        for arm in run.arms:
            r = run.results.get(arm, {"skipped": "not reached"})
            if not measured(r):
                what = f"skipped: {r['skipped']}" if "skipped" in r else f"failed: {r.get('error', '?')}"
                what = " ".join(what.replace("|", "/").split())
                lines.append(f"| {run.name} | {label(arm, r)} | {what} (unmeasured) "
                             "| | | | | | | | | |")
                continue
            speed = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if measured(base) else "n/a"
            pair, ref = r.get("equal_work"), reference(arm)
            if arm == ref:
                memory, same, diff = "1.00", "(itself)", ""
            elif pair:
                memory = f"{pair['x_memory']:.2f}"
                same = "yes" if pair["same_tokens_per_step"] else f"no (mean {pair['tokens_per_step_ratio']:.3f}x)"
                diff = f"{pair['max_loss_diff']:.4f}" if pair["max_loss_diff"] is not None else ""
            else:
                memory, same, diff = "n/a", f"{ref} unmeasured", ""
            mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
            last = r["losses"][-10:]
            loss = f"{sum(last) / len(last):.4f}" if last else ""
            lines.append(f"| {run.name} | {label(arm, r)} | {r['tokens_per_s']:.0f} | {speed} | {r['peak_gib']:.2f} | "
                         f"{memory} | {label(ref, {})} | {same} | {mfu} | {loss} | {diff} | "
                         f"{r['seconds']:.1f} |")
    return "\n".join(lines) + (
        "\n\nx HF+TRL defaults: real tokens/s against the baseline arm (padded batches). x memory: peak memory "
        "against the baseline arm that saw the same real tokens per step: packed arms against TRL's own "
        "packing=True (bfd, padding-free), unpacked arms against the padded baseline; 'same real tokens/step' "
        "says whether every step's real tokens were in fact equal (else the ratio of the means).\n"
        f"MFU = tokens/s x (4N + 2N_trainable for LoRA/QLoRA, 6N for full) / {peak_note}")




def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny configs on CPU (or GPU), a few steps")
    parser.add_argument("--quick", action="store_true", help="the preset that fits one 8-minute command on one GPU "
                        "(with --tiny: its structure on tiny models)")
    parser.add_argument("--runs", help="comma-separated run names (default: those of the mode)")
    parser.add_argument("--steps", type=int, help="training steps per arm (default 50; --quick 11; tiny 8)")
    parser.add_argument("--warmup", type=int, help="untimed steps at the start (default 5; --quick and tiny 2)")
    parser.add_argument("--rows", type=int, help="synthetic rows (default: enough for the steps)")
    parser.add_argument("--peak-tflops", type=float, help="dense bf16 peak of the device, for MFU")
    parser.add_argument("--options", help="comma-separated option arms after the ftcore arm, or 'all': "
                        f"{', '.join(OPTIONS)} (--quick: liger, sdpa-block or flex, unpacked)")
    parser.add_argument("--deadline-s", type=float, help="start no arm whose budget would end past this many "
                        "seconds from the start, and kill a started one there "
                        f"(--quick: {QUICK_DEADLINE_S:g})")
    parser.add_argument("--jsonl", type=Path, help="the JSON lines, written as each arm finishes "
                        "(default: a new file in the temp folder)")
    parser.add_argument("--json", type=Path, help="also write all measurements here at the end")
    parser.add_argument("--append-results", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    if args.quick:
        args.steps = args.steps or QUICK_STEPS
        args.warmup = args.warmup if args.warmup is not None else QUICK_WARMUP
        if args.deadline_s is None:
            args.deadline_s = QUICK_DEADLINE_S
    args.steps = args.steps or (8 if args.tiny else 50)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.tiny else 5)
    catalogue = TINY_RUNS if args.tiny else RUNS
    # The packed attention ftcore does not choose on CUDA (its default: varlen where flash_attn is, else flex).
    attention = "flex" if importlib.util.find_spec("flash_attn") is not None else "sdpa-block"
    if args.options is None:
        args.options = ["liger", attention, "unpacked"] if args.quick else []
    else:
        args.options = list(OPTIONS) if args.options == "all" else [o for o in args.options.split(",") if o]
    bad = [o for o in args.options if o not in OPTIONS]
    if bad:
        parser.error(f"unknown option arm(s) {', '.join(bad)}; there are {', '.join(OPTIONS)}")
    if args.quick and not args.runs:
        plan = [(tiny if args.tiny else name, keep) for name, tiny, keep in QUICK]
    else:
        names = args.runs.split(",") if args.runs else (DEFAULT_TINY_RUNS if args.tiny else DEFAULT_RUNS)
        unknown = [n for n in names if n not in catalogue]
        if unknown:
            parser.error(f"unknown run(s) {', '.join(unknown)}; this mode has {', '.join(catalogue)}")
        plan = [(name, True) for name in names]

    # Whether there is a GPU, through NVML: this process must never initialise CUDA (its forks could not use it).
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    import torch

    from ftcore_plugins.common.memory import gpu_visible

    gpu = gpu_visible() and torch.cuda.is_available()
    if not args.tiny and not gpu:
        sys.exit("gpu_throughput: no CUDA device; the 8B/1B runs need one (use --tiny on CPU)")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    args.jsonl = args.jsonl or Path(tempfile.gettempdir()) / f"ftcore-gpu-throughput-{stamp}-{os.getpid()}.jsonl"
    args.scratch = Path(tempfile.mkdtemp(prefix="ftcore-gpu-"))  # models, runs, cache: scratch
    atexit.register(shutil.rmtree, args.scratch, ignore_errors=True)
    os.environ.setdefault("FTCORE_CACHE_DIR", str(args.scratch / "cache"))
    device, preloaded = "CPU", PRELOAD
    if gpu:  # its name, and what this process may import, from a child of its own, which may initialise CUDA
        found, _, _ = in_child(lambda: probe(PRELOAD), args.scratch / "probe.json", 600, lambda pid: None)
        device = found.get("device") or f"a CUDA device (its name unread: {found.get('error')})"
        preloaded = PRELOAD[:found.get("preload", 0)]
    peak = args.peak_tflops or (next((v for k, v in PEAK_TFLOPS.items() if k in device), None) if gpu else None)
    runs: dict[str, Run] = {}
    for name, keep in plan:
        arch, method, max_length, batch_size = catalogue[name]
        arms = ["baseline", "baseline-packed", "ftcore", *(f"ftcore+{o}" for o in (args.options if keep else []))]
        work = args.scratch / name
        work.mkdir()
        runs[name] = Run(name, arch, method, max_length, batch_size, arms, work)
    order = {name: i for i, name in enumerate(runs)}
    schedule = sorted(((name, arm) for name, run in runs.items() for arm in run.arms),
                      key=lambda w: (TIER.get(w[1], 2), order[w[0]], runs[w[0]].arms.index(w[1])))
    settings = (f"{args.steps} steps per arm, {args.warmup} untimed"
                + (f"; deadline {args.deadline_s:g} s" if args.deadline_s is not None else ""))
    clock = Clock(args.deadline_s, runs, args.steps, gpu, peak * 1e12 if peak else None)
    lines = Lines(args.jsonl)
    print(f"JSON lines: {args.jsonl}", flush=True)
    say(f"device: {device}; {settings}; this process {os.getpid()}, each arm and model build in a fork of its own")
    lines.write("start", device=device, machine=machine(), argv=sys.argv[1:], pid=os.getpid(),
                scratch=str(args.scratch), steps=args.steps, warmup=args.warmup, deadline_s=args.deadline_s,
                peak_tflops=peak, schedule=[[n, a, round(clock.arm_budget(runs[n])[0], 1)] for n, a in schedule],
                build_budgets_s={arch: round(clock.build_budget(arch)[0], 1)
                                 for arch in dict.fromkeys(runs[n].arch for n, _ in schedule)})
    preload(preloaded)
    bench(runs, schedule, args, lines, peak * 1e12 if peak else None, gpu, clock)
    peak_note = (f"{peak:g} TFLOP/s (dense bf16 of {device})" if peak else
                 "no peak: MFU n/a on CPU unless --peak-tflops is given")
    out = table(runs, peak_note)
    lines.write("end", seconds=time.monotonic() - START)
    header = f"device: {device}; machine: {machine()}; {settings}"
    print()
    print(header)
    print()
    print(out, flush=True)
    if args.json:
        args.json.write_text(json.dumps({name: run.results for name, run in runs.items()}))
    if args.append_results:
        with (ROOT / "benchmarks" / "RESULTS.md").open("a", encoding="utf-8") as fh:
            fh.write(f"\n### gpu_throughput, {datetime.date.today()}\n\n{header}\n\n{out}\n")


if __name__ == "__main__":
    main()
