"""``ftcore init``: a starter plan from a few answers, with the reasoning in comments.

The decision tree is the one ML engineers use:

* GPU memory under 16 GB -> QLoRA (nf4, double quantization, r <= 32, gradient
  checkpointing); 16-48 GB -> LoRA (bf16, r 16-64); more -> full fine-tuning (spread over
  devices with DeepSpeed or FSDP).
* Alignment data: preference pairs where staying close to the base model matters little
  (low KL importance) -> DPO; where it matters (high) -> SFT, then a reward model, then PPO.
* Data size sets learning rate and epochs: under 1k rows a higher rate and 5-10 epochs,
  1k-10k rows 3-5 epochs, more 1-3.

Pure text generation: nothing here loads a model or imports torch.
"""

from __future__ import annotations

import argparse
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
    base = 2e-4 if adapter in ("lora", "qlora") else 2e-5
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


def write_plan(a: Answers) -> str:
    how, why_method = method(a.gpu_memory_gb)
    rlhf = (a.goal == "alignment" or a.kind == "preferences") and a.kl == "high" and a.goal != "domain" \
        and a.kind != "text"
    if how == "qlora" and rlhf:
        # The reward stage builds its model from a copy of the policy's weights, which 4-bit weights
        # cannot give: the smallest method all three stages share is LoRA with checkpointing.
        how, why_method = "lora", (why_method + "; but SFT -> reward -> PPO needs full-precision weights (the "
                                   "reward model starts from a copy of the policy), so LoRA on a bf16 base with "
                                   "gradient checkpointing: check `ftcore estimate plan.toml` says it fits")
    lr, epochs, why_schedule = schedule(a.rows, how)
    lines = [
        "# Written by `ftcore init`. Every choice below says why; change anything, then run",
        "#   ftcore validate plan.toml && ftcore run plan.toml",
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
    if how == "qlora":
        lines += ["[quantizer]", 'use = "bnb-nf4"', "bnb_4bit_use_double_quant = true", ""]
    if how == "full":
        lines += ["[adapter]", 'use = "full"', ""]
    else:
        r = 16 if how == "qlora" else 32
        lines += ["[adapter]", 'use = "lora"', f"r = {r}", f"lora_alpha = {2 * r}   # alpha = 2r, a common default",
                  'target_modules = "all-linear"   # every linear layer but lm_head', ""]
    lines += ["[data.train]", 'use = "json"' if a.data.endswith(".json") else 'use = "jsonl"',
              f'path = "{a.data}"', "validation = 0.05   # held out: evaluated as \"train:validation\"", ""]
    tight = how == "qlora" or (rlhf and a.gpu_memory_gb < 16)
    common = [f"epochs = {epochs}   # {why_schedule}", f"learning_rate = {lr:g}",
              f"gradient_checkpointing = {'true' if tight else 'false'}" + (
                  "   # trades compute for activation memory" if tight else "")]
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
        lines += [*stage, ""]
    if a.kind != "preferences":
        lines += ["[[evaluate]]", 'use = "perplexity"   # token-weighted, before and after training',
                  'data = "train:validation"', ""]
    lines += ["[[export]]", 'use = "adapter"' if how != "full" else 'use = "merged"', ""]
    return "\n".join(lines)


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
        parser.add_argument("--gpu-memory", help="GPU memory per device, e.g. 24GB (0 for CPU only)")
        parser.add_argument("--data", help="training data file (JSON, JSON Lines)")
        parser.add_argument("--kind", choices=KINDS, help="what the data holds")
        parser.add_argument("--rows", type=int, help="number of rows (counted from the file when omitted)")
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
        out.write_text(write_plan(answers), encoding="utf-8")
        print(f"wrote {out}: {method(gb)[0]}, {rows:,} rows; check it with: ftcore validate {out}")
        return 0


@ftcore.hookimpl
def register_commands(register):
    register(InitCommand)
