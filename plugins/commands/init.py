"""``ftcore init``: a starter plan from a few answers, with the reasoning in comments.

The decision tree is the one ML engineers use:

* GPU memory under 16 GB -> QLoRA (nf4, double quantization, r <= 32, gradient
  checkpointing); 16-48 GB -> LoRA (bf16, r 16-64); more -> full fine-tuning (spread over
  devices with DeepSpeed or FSDP).
* Alignment data: preference pairs where staying close to the base model matters little
  (low KL importance) -> DPO; where it matters (high) -> SFT, then a reward model, then PPO.
* Data size sets learning rate and epochs: under 1k rows a higher rate and 5-10 epochs,
  1k-10k rows 3-5 epochs, more 1-3.

With the model's config at hand (a local folder, a cached hub id, or ``--config``), the plan is
fitted: the method, batch size, gradient accumulation, max_length and gradient checkpointing
are chosen so that ``ftcore estimate`` says it fits the GPU memory with a margin (:func:`fit`),
and the plan's comments say so. Without it, the tree above decides alone.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import ftcore
from ftcore.command import Command
from ftcore.errors import FtcoreError

KINDS = ("instructions", "chat", "preferences", "text")
GOALS = ("task", "domain", "alignment")


@dataclass
class Answers:
    model: str  # a local folder or a hub id
    gpu_memory_gb: float  # 0 for CPU only
    data: str  # path to the data file
    kind: str  # instructions, chat, preferences, text
    rows: int
    goal: str  # task, domain, alignment
    kl: str = "low"  # alignment only: how much staying close to the base model matters
    name: str = "run"
    moe: str | None = None  # a mixture of experts' total and active parameters (moe_size), when its config is at hand


def parse_gb(text: str) -> float:
    """'24GB', '24 GiB', '16', '0', 'cpu' -> gigabytes."""
    text = str(text).strip().lower()
    if text in ("", "0", "cpu", "none"):
        return 0.0
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(g|gb|gib)?", text)
    if not m:
        raise ValueError(f"not a memory size: {text!r} (e.g. 24GB, or 0 for CPU only)")
    return float(m.group(1))


def count_rows(path: Path) -> int | None:
    """Rows in a JSON Lines / JSON array / CSV / text file, without loading it whole."""
    try:
        if path.suffix == ".json":
            data = json.loads(path.read_text(encoding="utf-8"))
            return len(data) if isinstance(data, list) else None
        with path.open("rb") as fh:
            lines = sum(1 for line in fh if line.strip())
        return lines - 1 if path.suffix in (".csv", ".tsv") else lines
    except (OSError, ValueError):
        return None


def schedule(rows: int, adapter: str) -> tuple[float, int, str]:
    """(learning rate, epochs, why) for this much data and this method."""
    base = 2e-5 if adapter == "full" else 2e-4
    if rows < 1_000:
        return base * 1.5, 8, f"{rows:,} rows is small: a higher learning rate and 5-10 epochs"
    if rows <= 10_000:
        return base, 4, f"{rows:,} rows: 3-5 epochs"
    return base, 2, f"{rows:,} rows is plenty: 1-3 epochs"


def method(gb: float) -> tuple[str, str]:
    """('qlora' | 'lora' | 'full', why)."""
    if gb < 16:
        where = "no GPU" if gb == 0 else f"{gb:g} GB of GPU memory"
        return "qlora", (f"{where}: QLoRA (4-bit nf4 base with double quantization, LoRA r <= 32, gradient "
                         "checkpointing) fits a 7B model in about 6-8 GB")
    if gb <= 48:
        return "lora", f"{gb:g} GB: LoRA on a bf16 base (r 16-64) fits a 7B model in about 16 GB"
    return "full", (f"{gb:g} GB: enough for full fine-tuning; for large models spread it over devices "
                    "with DeepSpeed ZeRO or FSDP")


@dataclass
class Choice:
    """What ``fit`` chose for the memory at hand, and the estimate that says it fits."""

    method: str  # full, lora, or a quantized method (QUANTIZED)
    batch: int
    accumulation: int
    max_length: int
    checkpointing: bool
    why: list[str]  # comment lines for the plan
    r: int | None = None  # LoRA rank; None: the method's default
    optimizer: str | None = None  # None: the trainer's default
    offload: bool = False  # activation offloading (the checkpointed layers' inputs in host memory)
    sp_size: int = 1  # sequence parallelism: each row split across this many GPUs (DeepSpeed's Ulysses)
    tiled: bool = False  # tiled_mlp: each MLP run over shards of the row (DeepSpeed's TiledMLP)


def is_rlhf(a: Answers) -> bool:
    return (a.goal == "alignment" or a.kind == "preferences") and a.kl == "high" and a.goal != "domain" \
        and a.kind != "text"


def write_plan(a: Answers, choice: Choice | None = None) -> str:
    """The plan for the answers; ``choice`` (from :func:`fit`) sets the method and the memory knobs."""
    how, why_method = method(a.gpu_memory_gb)
    rlhf = is_rlhf(a)
    if choice is not None:
        how, why_method = choice.method, f"{a.gpu_memory_gb:g} GB of GPU memory: see the estimate above"
    elif how in QUANTIZED and rlhf:
        # The reward stage builds its model from a copy of the policy's weights, which 4-bit weights
        # cannot give: the smallest method all three stages share is LoRA with checkpointing.
        how, why_method = "lora", (why_method + "; but SFT -> reward -> PPO needs full-precision weights (the "
                                   "reward model starts from a copy of the policy), so LoRA on a bf16 base with "
                                   "gradient checkpointing: check `ftcore estimate plan.toml` says it fits")
    lr, epochs, why_schedule = schedule(a.rows, how)
    lines = [
        "# Written by `ftcore init`. Every choice below says why; change anything, then run",
        "#   ftcore validate plan.toml && ftcore run plan.toml",
        *(f"# {line}" for line in (choice.why if choice else [])),
        *([f"# Mixture of experts: {a.moe}.", "# Memory holds every expert; the compute per token follows the active "
           "parameters."] if a.moe else []),
        "",
        "[run]",
        f'name = "{a.name}"',
        "seed = 42",
        "",
        "[model]",
        'use = "hf"',
        f'path = "{a.model}"',
    ]
    if how == "lora":
        lines += ['dtype = "bfloat16"   # half the memory of fp32 weights, and what LoRA trains against']
    lines += ["", "[template]", 'use = "native"   # the tokenizer\'s own chat template', ""]
    lines += [f"# {why_method}"]
    if how in QUANTIZED:
        lines += ["[quantizer]", *QUANTIZED[how][0], ""]
    if how == "full":
        lines += ["[adapter]", 'use = "full"', ""]
    else:
        r = (choice.r if choice is not None else None) or (16 if how in QUANTIZED else 32)
        lines += ["[adapter]", 'use = "lora"', f"r = {r}", f"lora_alpha = {2 * r}   # alpha = 2r, a common default",
                  'target_modules = "all-linear"   # every linear layer but lm_head', ""]
    lines += ["[data.train]", 'use = "json"' if a.data.endswith(".json") else 'use = "jsonl"',
              f'path = "{a.data}"', "validation = 0.05   # held out: evaluated as \"train:validation\"", ""]
    tight = how in QUANTIZED or (rlhf and a.gpu_memory_gb < 16)
    common = [f"epochs = {epochs}   # {why_schedule}", f"learning_rate = {lr:g}",
              f"gradient_checkpointing = {'true' if tight else 'false'}" + (
                  "   # trades compute for activation memory" if tight else "")]
    knobs: list[str] = []  # every stage's memory settings, when fitted
    if choice is not None:
        common = common[:2]
        knobs = [f"batch_size = {choice.batch}",
                 f"gradient_accumulation_steps = {choice.accumulation}   # an effective batch of "
                 f"{choice.batch * choice.accumulation}",
                 f"max_length = {choice.max_length}",
                 f"gradient_checkpointing = {'true' if choice.checkpointing else 'false'}"]
        if choice.optimizer:
            knobs.append(f'optimizer = "{choice.optimizer}"   # 8-bit states, paged to the CPU under pressure')
        if choice.offload:
            knobs.append("activation_offloading = true   # each layer's saved input in host memory, not the GPU's")
        if choice.tiled:
            knobs.append("tiled_mlp = true   # each MLP over shards of the row: one shard's activations at a time, "
                         "for one more MLP forward a step")
    stages: list[list[str]] = []
    if a.goal == "domain" or a.kind == "text":
        stages.append(["# Domain shift on raw text: continued pre-training on every token.", "[[stage]]",
                       'name = "pretrain"', 'trainer = "pretrain"', 'data = "train"', *common, "max_length = 1024"])
    elif a.goal == "alignment" or a.kind == "preferences":
        if a.kl == "high":
            stages += [
                ["# Alignment where staying close to the base model matters (high KL importance):",
                 "# SFT, then a reward model, then PPO with a KL penalty against the SFT policy.",
                 "# Preference pairs give SFT their chosen answers.", "[[stage]]", 'name = "sft"',
                 'trainer = "sft"', 'data = "train"', *common],
                ["[[stage]]", 'name = "reward"', 'trainer = "reward"', 'data = "train"', "epochs = 1"],
                ["[[stage]]", 'name = "ppo"', 'trainer = "ppo"', 'data = "train"', 'reward_model = "reward"',
                 "learning_rate = 1e-6"],
            ]
        else:
            stages.append(["# Preference pairs and low KL importance: DPO, directly on the pairs.", "[[stage]]",
                           'name = "dpo"', 'trainer = "dpo"', 'data = "train"', "epochs = 1",
                           "learning_rate = 5e-6   # DPO wants a much lower rate than SFT", "beta = 0.1"])
    else:
        stages.append([f"# {a.kind.title()} data for a task: supervised fine-tuning, loss on the answers only.",
                       "[[stage]]", 'name = "sft"', 'trainer = "sft"', 'data = "train"', *common,
                       "max_length = 2048"])
    for stage in stages:
        if knobs:  # the fitted settings replace the defaults' max_length
            stage = [line for line in stage if not line.startswith("max_length")] + knobs
        lines += [*stage, ""]
    if a.kind != "preferences":
        lines += ["[[evaluate]]", 'use = "perplexity"   # token-weighted, before and after training',
                  'data = "train:validation"', ""]
    lines += ["[[export]]", 'use = "adapter"' if how != "full" else 'use = "merged"', ""]
    if choice is not None and choice.sp_size > 1:
        n = choice.sp_size
        lines += [f"# max_length {choice.max_length} does not fit one GPU: sequence parallelism splits each row across "
                  f"{n} GPUs (DeepSpeed's Ulysses: each holds the whole model and 1/{n} of every row's columns; "
                  f"inside attention the whole row for 1/{n} of the heads). {n} is the smallest divisor of the "
                  "model's attention heads that fits; the processes beyond it would run data parallel.",
                  "[distributed]", 'engine = "deepspeed"   # Ulysses runs on DeepSpeed (ZeRO-2 shards the optimizer)',
                  f"nproc_per_node = {n}   # one process a GPU", f"sp_size = {n}", ""]
    return "\n".join(lines)


EFFECTIVE_BATCH = 16  # samples per optimizer step, kept as the batch shrinks (gradient accumulation)
MARGIN = 0.10  # of the GPU memory left free: the estimate's error and the allocator's fragmentation
LENGTHS = (2048, 1024, 512)
BATCHES = (8, 4, 2, 1)
# The quantized methods, leanest last: each one's [quantizer] lines and how the why-line names it. The 8-bit
# base comes before QLoRA (closer to the original weights); HQQ's 3 and 2 bits after it, where hqq is installed.
QUANTIZED = {
    "lora-int8": (['use = "bnb-int8"'], "the 8-bit quantizer"),
    "qlora": (['use = "bnb-nf4"', "bnb_4bit_use_double_quant = true"], "the 4-bit quantizer"),
    "qlora-hqq3": (['use = "hqq"', "nbits = 3"], "the 3-bit quantizer"),
    "qlora-hqq2": (['use = "hqq"', "nbits = 2", "group_size = 32"], "the 2-bit quantizer"),
}
NEEDS = {"qlora-hqq3": "hqq", "qlora-hqq2": "hqq"}  # the package a method's quantizer needs beyond ftcore's own


def quantized_methods() -> list[str]:
    """The quantized methods whose quantizer is installed, in ``QUANTIZED``'s order."""
    import importlib.util

    return [m for m in QUANTIZED if m not in NEEDS or importlib.util.find_spec(NEEDS[m]) is not None]


# QLoRA's leaner settings, in order of preference, before a shorter max_length: (r, optimizer, activation
# offloading), None the default. The QLoRA recipe's paged 8-bit AdamW (2 bytes of state a parameter against
# 8), then offloading (a copy of each layer's input to the host and back, a step), then rank 8.
LEANER = {m: ((None, None, False), (None, "paged_adamw_8bit", False), (None, "paged_adamw_8bit", True),
              (8, "paged_adamw_8bit", True)) for m in ("qlora", "qlora-hqq3", "qlora-hqq2")}


# Trainers sequence parallelism runs with (plugins/trainers/_sequence_parallel.py, SEQUENCE_PARALLEL_TRAINERS).
SP_TRAINERS = ("sft", "pretrain")


def attention_heads(model: str, home: Path, config: Path | None) -> int | None:
    """The model's attention heads, from the config at hand (``--config``, the local folder's, the hub cache's)."""
    file = config if config is not None else home / model / "config.json"
    if not file.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(model, "config.json")
        except Exception:
            return None
        if not isinstance(cached, str):
            return None
        file = Path(cached)
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    heads = raw.get("num_attention_heads") or (raw.get("text_config") or {}).get("num_attention_heads")
    return heads if isinstance(heads, int) and heads > 0 else None


def sp_sizes(heads: int | None, trainer_ok: bool) -> list[int]:
    """One device, then each divisor of the heads above 1, smallest first (Ulysses hands each process whole
    heads), when the plan's trainer runs sequence parallel."""
    if not heads or not trainer_ok:
        return [1]
    return [1, *(n for n in range(2, heads + 1) if heads % n == 0)]


def fit(a: Answers, out: Path, config: Path | None, max_length: int | None = None) -> Choice | None:
    """The first plan, in order of preference, that ``ftcore estimate`` (CUDA, bf16) says fits the
    GPU memory less ``MARGIN``: the method the memory suggests and then the leaner ones; within a
    method the longest ``max_length``, then no gradient checkpointing, then (QLoRA) the default
    optimizer and rank before ``LEANER``'s, then the largest batch (gradient accumulation keeps the
    effective batch). None when no config is at hand.

    With ``max_length`` (the context the plan must train on) that length is kept, and a LoRA or full-precision
    plan of ``SP_TRAINERS`` tries ``tiled_mlp`` (after checkpointing off, before it on); when no plan fits one
    GPU at it, sequence parallelism is proposed: ``sp_size`` the smallest divisor of the model's attention
    heads whose per-rank estimate fits (engine DeepSpeed, one process a GPU; not with QLoRA, whose 4-bit
    weights DeepSpeed does not shard, and only for the trainers it runs with, ``SP_TRAINERS``)."""
    import importlib.util
    import shutil
    import tempfile

    from ftcore.plugins import plugins_with_warnings
    from ftcore.plan import load_plan

    from ftcore_plugins.commands.estimate import GiB, estimate_plan, human

    os.environ["HF_HUB_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"  # a config is read, never downloaded
    budget = int(a.gpu_memory_gb * GiB * (1 - MARGIN))
    lengths = (max_length,) if max_length else LENGTHS
    # write_plan's stage: pretrain for raw text or a domain shift, else SFT unless the data is for alignment
    trainer_ok = a.goal == "domain" or a.kind == "text" or not (a.goal == "alignment" or a.kind == "preferences")
    sizes = sp_sizes(attention_heads(a.model, out.resolve().parent, config), trainer_ok) if max_length else [1]
    # A long context may fit one GPU with its MLPs tiled (DeepSpeed's TiledMLP) before it needs several; on a
    # full-precision base (the quantizers' layers are not tried with it).
    tile = bool(max_length) and trainer_ok and not is_rlhf(a) and importlib.util.find_spec("deepspeed") is not None
    methods = ("full", "lora", *quantized_methods())
    order = list(methods[methods.index(method(a.gpu_memory_gb)[0]):])
    if is_rlhf(a):
        order = [m for m in order if m not in QUANTIZED] or ["lora"]  # the reward model copies full-precision weights
    with tempfile.TemporaryDirectory(prefix="ftcore-init-", dir=out.resolve().parent) as tmp:
        # The candidates sit in a folder beside the plan: its relative paths are rewritten for them.
        home = out.resolve().parent
        model = os.path.relpath(home / a.model, tmp) if (home / a.model).exists() else a.model
        if config is not None:  # the model's config alone, where its folder is not at hand
            folder = Path(tmp) / "config"
            folder.mkdir()
            shutil.copy(config, folder / "config.json")
            model = "config"
        data = os.path.relpath(home / a.data, tmp)
        candidate = Path(tmp) / "plan.toml"
        _, reg = plugins_with_warnings(quiet=True)
        tried = 0

        def peak(choice: Choice) -> int | None:
            nonlocal tried
            tried += 1
            text = write_plan(Answers(**{**a.__dict__, "model": model, "data": data}), choice)
            candidate.write_text(text, encoding="utf-8")
            try:
                estimate = estimate_plan(load_plan(candidate, reg), device="cuda", budget=budget)
            except FtcoreError:
                return None
            return estimate.peak

        # DeepSpeed does not shard 4-bit weights: split across GPUs, the leanest method is LoRA on a bf16 base.
        split_order = [m for m in order if m not in QUANTIZED] or ["lora"]
        for sp, how in ((sp, how) for sp in sizes for how in (order if sp == 1 else split_order)):
            if sp > 1 and lengths[-1] % sp:
                continue  # each process takes an equal slice of a row
            variants = LEANER.get(how, ((None, None, False),))
            tileds = (False, True) if tile and how in ("full", "lora") else (False,)
            lean = Choice(how, 1, EFFECTIVE_BATCH, lengths[-1], True, [], *variants[-1], sp_size=sp, tiled=tileds[-1])
            if (p := peak(lean)) is None:
                if sp > 1:
                    continue  # a plan sequence parallelism cannot run (DeepSpeed absent, the model's layers)
                return None  # the config cannot be read: no estimate to fit against
            if p > budget:
                continue
            # The bnb quantizers turn checkpointing on for QLoRA (their own option): no choice there.
            checkpointings = (True,) if how in QUANTIZED else (False, True)
            for length, checkpointing, tiled, (r, optimizer, offload), batch in itertools.product(
                    lengths, checkpointings, tileds, variants, BATCHES):
                choice = Choice(how, batch, max(1, EFFECTIVE_BATCH // batch), length, checkpointing, [], r, optimizer,
                                offload, sp_size=sp, tiled=tiled)
                need = peak(choice)
                if need is None or need > budget:
                    continue
                leaner = "" if len(variants) == 1 else (
                    ", then " + " > ".join(_variant(v) for v in variants) + f" ({_variant((r, optimizer, offload))})")
                per = f" per GPU, each of {sp} sharing every row (sequence parallelism)" if sp > 1 else ""
                choice.why = [
                    f"Fitted to {a.gpu_memory_gb:g} GB of GPU memory: `ftcore estimate --device cuda` "
                    f"says {human(need)} at its peak{per}, within {human(budget)} (the memory less a "
                    f"{MARGIN:.0%} margin); {tried} settings tried, in this order of preference:",
                    *([f"  one GPU, then sp_size {' > '.join(map(str, sizes[1:]))} (the divisors of the model's "
                       f"attention heads) at max_length {length} ({sp} chosen: the context does not fit one GPU),"]
                      if sp > 1 else []),
                    f"  method {' > '.join(order if sp == 1 else split_order)} ({how} chosen"
                    + ("; quantized weights DeepSpeed does not shard" if sp > 1 and set(order) & set(QUANTIZED) else "")
                    + "), then max_length "
                    f"{' > '.join(map(str, lengths))} ({length}), then "
                    + (f"gradient checkpointing on ({QUANTIZED[how][1]}'s own)" if how in QUANTIZED else
                       f"gradient checkpointing off > on ({'on' if checkpointing else 'off'})")
                    + (f", then tiled_mlp off > on ({'on' if tiled else 'off'})" if len(tileds) > 1 else "")
                    + f"{leaner}, then batch {' > '.join(map(str, BATCHES))} "
                    f"({batch}, accumulating {choice.accumulation} for an effective batch of "
                    f"{batch * choice.accumulation}).",
                    "Check it on the real hardware: ftcore estimate plan.toml --device cuda --budget "
                    f"{a.gpu_memory_gb:g}GB"]
                return choice
        split = f", nor split across up to {sizes[-1]} GPUs by sequence parallelism" if len(sizes) > 1 else ""
        raise FtcoreError(f"init: no plan fits {a.gpu_memory_gb:g} GB of GPU memory even as {order[-1]} with batch 1, "
                          f"max_length {lengths[-1]} and gradient checkpointing{split} ({tried} settings estimated); "
                          "use more memory per GPU, or several GPUs with DeepSpeed ZeRO-3 (see docs/distributed.md)")


def moe_size(model: str, home: Path, config: Path | None) -> str | None:
    """The total and active parameters of a mixture-of-experts model whose config is at hand (``--config``, the
    local folder's, or the local hub cache's: never the network), from the model built on the meta device; None
    for a dense model, or without a config."""
    file = config if config is not None else home / model / "config.json"
    if not file.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(model, "config.json")
        except Exception:  # not a hub id
            return None
        if not isinstance(cached, str):
            return None
        file = Path(cached)
    try:
        import torch
        from transformers import CONFIG_MAPPING

        from ftcore_plugins.common.estimate import meta_model_from_config, moe_line, moe_parameters

        model_config = CONFIG_MAPPING[json.loads(file.read_text(encoding="utf-8"))["model_type"]].from_json_file(file)
        moe = moe_parameters(meta_model_from_config(model_config, torch.float32), model_config)
    except Exception:  # a config transformers cannot build (remote code): nothing to say
        return None
    return moe_line(moe) if moe else None


def _variant(variant: tuple[int | None, str | None, bool]) -> str:
    r, optimizer, offload = variant
    return f"r {r or 16} with {optimizer or 'the default optimizer'}" + (", activations offloaded" if offload else "")


def ask(prompt: str, default: str | None = None, choices: tuple[str, ...] | None = None) -> str:
    hint = f" ({'/'.join(choices)})" if choices else ""
    shown = f" [{default}]" if default else ""
    while True:
        value = input(f"{prompt}{hint}{shown}: ").strip() or (default or "")
        if value and (not choices or value in choices):
            return value
        print(f"  please answer{' one of ' + ', '.join(choices) if choices else ''}")


class InitCommand(Command):
    """Write a starter plan from a few answers.

    Write a starter plan: method, rank, learning rate and epochs chosen from your GPU memory, data and
    goal, each explained in a comment. Answers not given as flags are asked for.
    """

    name = "init"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("-o", "--output", default="plan.toml", help="where to write the plan (default plan.toml)")
        parser.add_argument("--model", help="base model: a local folder or a hub id")
        parser.add_argument("--config", help="the model's config.json, when --model is a hub id not downloaded "
                                             "here: the plan is fitted to the GPU memory with it")
        parser.add_argument("--gpu-memory", help="GPU memory per device, e.g. 24GB (0 for CPU only)")
        parser.add_argument("--data", help="training data file (JSON, JSON Lines)")
        parser.add_argument("--kind", choices=KINDS, help="what the data holds")
        parser.add_argument("--rows", type=int, help="number of rows (counted from the file when omitted)")
        parser.add_argument("--max-length", type=int, help="the context to train on, in tokens: kept, and split "
                                                            "across GPUs by sequence parallelism when it does not fit "
                                                            "one (default: the longest of 2048/1024/512 that fits)")
        parser.add_argument("--goal", choices=GOALS, help="what the fine-tune is for")
        parser.add_argument("--kl", choices=("low", "high"), default=None,
                            help="alignment: how much staying close to the base model matters")
        parser.add_argument("--name", help="run name (default: the plan file's name)")
        parser.add_argument("--force", action="store_true", help="overwrite an existing plan file")

    def run(self, args: argparse.Namespace) -> int:
        out = Path(args.output)
        if out.exists() and not args.force:
            raise FtcoreError(f"{out}: already exists; choose another --output, or --force to overwrite it")
        interactive = sys.stdin.isatty()
        questions = {
            "model": ("Base model (local folder or hub id)", None, None),
            "gpu_memory": ("GPU memory per device, e.g. 24GB (0 for CPU only)", "0", None),
            "data": ("Training data file", None, None),
            "kind": ("What the data holds", "instructions", KINDS),
            "goal": ("What the fine-tune is for", "task", GOALS),
        }
        values = {}
        for key, (prompt, default, choices) in questions.items():
            value = getattr(args, key)
            if value is None and interactive:
                value = ask(prompt, default, choices)
            if value is None:
                raise FtcoreError(f"init: --{key.replace('_', '-')} is required when not asked interactively")
            values[key] = value
        kl = args.kl or ("low" if values["goal"] != "alignment" or not interactive
                         else ask("How much must the model stay close to the base (KL importance)", "low",
                                  ("low", "high")))
        try:
            gb = parse_gb(values["gpu_memory"])
        except ValueError as exc:
            raise FtcoreError(f"init: --gpu-memory: {exc}") from None
        data = Path(values["data"])
        rows = args.rows if args.rows is not None else count_rows(data)
        if rows is None:
            raise FtcoreError(f"init: cannot count the rows of {data}; give --rows")
        # Paths in a plan are relative to the plan's own folder.
        data_ref = os.path.relpath(data.resolve(), out.resolve().parent) if data.exists() else str(data)
        model = values["model"]
        if Path(model).exists():
            model = os.path.relpath(Path(model).resolve(), out.resolve().parent)
        answers = Answers(model=model, gpu_memory_gb=gb, data=data_ref, kind=values["kind"], rows=rows,
                          goal=values["goal"], kl=kl, name=args.name or out.stem)
        if args.config is not None and not Path(args.config).is_file():
            raise FtcoreError(f"init: --config: no such file: {args.config}")
        config = Path(args.config) if args.config else None
        answers.moe = moe_size(model, out.resolve().parent, config)
        if args.max_length is not None and args.max_length < 1:
            raise FtcoreError(f"init: --max-length: must be a positive number of tokens, got {args.max_length}")
        choice = fit(answers, out, config, args.max_length) if gb > 0 else None
        text = write_plan(answers, choice)
        if choice is None and args.max_length:
            text = re.sub(r"^max_length = \d+", f"max_length = {args.max_length}", text, flags=re.M)
        out.write_text(text, encoding="utf-8")
        moe = f"; mixture of experts: {answers.moe}" if answers.moe else ""
        if choice is not None:
            sp = (f"; the context does not fit one GPU: sequence parallelism, sp_size {choice.sp_size} (each row split "
                  f"across {choice.sp_size} GPUs, engine deepspeed, nproc_per_node {choice.sp_size})"
                  if choice.sp_size > 1 else "")
            print(f"wrote {out}: {choice.method}, batch {choice.batch} x {choice.max_length} tokens (accumulating "
                  f"{choice.accumulation}), checkpointing {'on' if choice.checkpointing else 'off'}"
                  f"{', MLPs tiled' if choice.tiled else ''}, fitted to "
                  f"{gb:g} GB{' per GPU' if sp else ''} by ftcore estimate{sp}; {rows:,} rows{moe}; check it with: "
                  f"ftcore validate {out}")
        else:
            why = "CPU only" if gb == 0 else "the model's config is not at hand (give a local folder or --config)"
            print(f"wrote {out}: {method(gb)[0]}, {rows:,} rows, not fitted ({why}){moe}; check it with: "
                  f"ftcore validate {out} and ftcore estimate {out}")
        return 0


@ftcore.hookimpl
def register_commands(register):
    register(InitCommand)
