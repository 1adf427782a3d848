"""How close ``ftcore estimate`` comes to the memory a real run measures, per method.

    python benchmarks/memory_estimate.py [--only NAME ...] [--jobs 2] [--keep DIR]

Writes a small project (generated text and chat data, and for bnb-nf4 a randomly
initialised ~55M-parameter Llama saved as a local checkpoint), then for each configuration
runs ``ftcore estimate PLAN --json`` and ``ftcore run PLAN`` as a user would, each in its own
process, and prints the estimate beside the run's measured peak (``summary.json`` ->
``memory`` -> ``"<stage>: trained"`` -> ``peak_rss_mib``). ``tests/test_estimate.py`` uses
the same configurations.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = 0.25

MODELS = {
    # scratch llama, hidden 64 / 2 layers: the process and framework are nearly everything
    "tiny": 'use = "scratch"\nhidden_size = 64\nnum_layers = 2\nnum_heads = 4\ntokenizer_data = ["text"]\n'
            'vocab_size = 2048',
    # scratch llama, 54.8M parameters: weights, gradients and optimizer state dominate
    "small": 'use = "scratch"\nhidden_size = 640\nnum_layers = 10\nnum_heads = 10\nintermediate_size = 1728\n'
             'tokenizer_data = ["text"]\nvocab_size = 8192',
    # the same architecture as a local checkpoint, for the bitsandbytes quantizers (hf loader)
    "small-hf": 'use = "hf"\npath = "small-hf"',
    # scratch llama, hidden 256 / 4 layers at 8 x 512 tokens: activations dominate
    "medium": 'use = "scratch"\nhidden_size = 256\nnum_layers = 4\nnum_heads = 4\nintermediate_size = 704\n'
              'tokenizer_data = ["text"]\nvocab_size = 4096',
    # scratch llama, hidden 128 / 4 layers / MLP 1024 at one 4,096-token row: the MLPs' activations dominate
    "long": 'use = "scratch"\nhidden_size = 128\nnum_layers = 4\nnum_heads = 4\nintermediate_size = 1024\n'
            'max_position_embeddings = 4096\ntokenizer_data = ["text"]\nvocab_size = 2048',
}
SMALL_HF = dict(hidden_size=640, num_hidden_layers=10, num_attention_heads=10, intermediate_size=1728,
                vocab_size=8192)


@dataclass
class Config:
    name: str
    model: str
    adapter: str  # "full", "lora" (r = 8), or the plan's adapter value as TOML
    checkpointing: bool = False
    quantizer: str = "none"
    trainer: str = "pretrain"
    batch_size: int = 2
    seq_len: int = 128
    steps: int = 2
    extra: str = ""  # more stage options, as TOML lines
    notes: list[str] = field(default_factory=list)

    def plan(self) -> str:
        data = "text" if self.trainer == "pretrain" else "chat"
        adapter = {"full": '"full"', "lora": '{ use = "lora", r = 8 }'}.get(self.adapter, self.adapter)
        quantizer = f'[quantizer]\nuse = "{self.quantizer}"\n' if self.quantizer != "none" else ""
        return f"""[run]
name = "{self.name}"
seed = 1

[model]
{MODELS[self.model]}

{quantizer}
[template]
use = "chatml"

[data.text]
use = "jsonl"
path = "text.jsonl"

[data.chat]
use = "jsonl"
path = "chat.jsonl"

[[stage]]
name = "train"
trainer = "{self.trainer}"
data = "{data}"
adapter = {adapter}
max_steps = {self.steps}
batch_size = {self.batch_size}
max_length = {self.seq_len}
gradient_checkpointing = {str(self.checkpointing).lower()}
logging_steps = 1
{self.extra}"""


CONFIGS = [
    Config("tiny-full", "tiny", "full", batch_size=4, seq_len=256),
    Config("tiny-lora", "tiny", "lora", trainer="sft", batch_size=4, seq_len=256),
    Config("small-full", "small", "full"),
    Config("small-full-ckpt", "small", "full", checkpointing=True),
    Config("small-lora", "small", "lora"),
    Config("small-lora-ckpt", "small", "lora", checkpointing=True),
    Config("small-qlora-nf4", "small-hf", "lora", quantizer="bnb-nf4", trainer="sft"),
    Config("long-lora-tiled", "long", "lora", batch_size=1, seq_len=4096, extra="tiled_mlp = true"),
]
# Not in the tests (minutes more on a small machine): activation-heavy steps, where glibc's heap
# retention shows and the estimate prints a note saying so.
EXTRA = [Config("medium-full", "medium", "full", batch_size=8, seq_len=512),
         Config("long-lora", "long", "lora", batch_size=1, seq_len=4096),
         Config("small-lora-4x256", "small", "lora", batch_size=4, seq_len=256),
         Config("small-lora-4x256-ckpt", "small", "lora", checkpointing=True, batch_size=4, seq_len=256)]

# One per remaining adapter method and quantizer, on the small model (2 x 128 tokens, sft on chat):
# `--only` picks them; docs/methods.md shows their results.
METHODS = [
    Config("small-dora", "small", '{ use = "dora", r = 8 }', trainer="sft"),
    Config("small-rslora", "small", '{ use = "rslora", r = 8 }', trainer="sft"),
    Config("small-loraplus", "small", '{ use = "loraplus", r = 8 }', trainer="sft"),
    Config("small-pissa", "small", '{ use = "pissa", r = 8 }', trainer="sft"),
    Config("small-olora", "small", '{ use = "olora", r = 8 }', trainer="sft"),
    Config("small-ia3", "small", '"ia3"', trainer="sft"),
    Config("small-prompt", "small", '{ use = "prompt_tuning", num_virtual_tokens = 16 }', trainer="sft"),
    Config("small-prefix", "small", '{ use = "prefix_tuning", num_virtual_tokens = 16 }', trainer="sft"),
    Config("small-freeze", "small", '{ use = "freeze", trainable_layers = 2 }', trainer="sft"),
    Config("small-full-sft", "small", "full", trainer="sft"),
    Config("small-lora-sft", "small", "lora", trainer="sft"),
    Config("small-qlora-fp4", "small-hf", "lora", quantizer="bnb-fp4", trainer="sft"),
    Config("small-lora-int8", "small-hf", "lora", quantizer="bnb-int8", trainer="sft"),
]


# -- the project ------------------------------------------------------------------------------
def write_project(folder: Path, *, hf_model: bool = True) -> Path:
    """Generated data (random words, so a BPE tokenizer fills its vocabulary and rows fill
    max_length), and the local checkpoint the bnb configurations load."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(6000)]

    def sentence(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n)) + "."

    with (folder / "text.jsonl").open("w") as fh:
        for _ in range(300):
            fh.write(json.dumps({"text": " ".join(sentence(12) for _ in range(20))}) + "\n")
    with (folder / "chat.jsonl").open("w") as fh:
        for _ in range(64):
            fh.write(json.dumps({"messages": [
                {"role": "user", "content": sentence(20)},
                {"role": "assistant", "content": " ".join(sentence(15) for _ in range(12))}]}) + "\n")
    if hf_model and not (folder / "small-hf" / "config.json").exists():
        _save_small_hf(folder)
    return folder


def _save_small_hf(folder: Path) -> None:
    """In a subprocess, so the caller never imports torch for it."""
    code = f"""
import json, torch
from pathlib import Path
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast
folder = Path({str(folder)!r})
texts = [json.loads(line)["text"] for line in (folder / "text.jsonl").open()]
specials = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size={SMALL_HF['vocab_size']}, special_tokens=specials,
    show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=specials[0], pad_token=specials[1],
                                    additional_special_tokens=specials[2:])
sizes = {SMALL_HF!r}
sizes["vocab_size"] = len(tokenizer)
config = AutoConfig.for_model("llama", max_position_embeddings=512, tie_word_embeddings=True,
    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **sizes)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
model.save_pretrained(folder / "small-hf")
tokenizer.save_pretrained(folder / "small-hf")
"""
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)


# -- measuring and estimating -----------------------------------------------------------------
def _cli(args: list[str], env: dict[str, str] | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ftcore", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def estimate(config: Config, folder: Path) -> dict:
    plan = folder / f"{config.name}.toml"
    plan.write_text(config.plan())
    out = _cli(["estimate", str(plan), "--json", "--device", "cpu"])
    if out.returncode != 0:
        raise RuntimeError(f"estimate {config.name} failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout)


def measure(config: Config, folder: Path) -> dict:
    """Run the plan and return its summary's memory points (MiB)."""
    plan = folder / f"{config.name}.toml"
    plan.write_text(config.plan())
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"ftcore-cache-{config.name}-") as cache:  # no warm cache from another run
        out = _cli(["run", str(plan), "--force"], env={"FTCORE_CACHE_DIR": cache})
    if out.returncode != 0:
        raise RuntimeError(f"run {config.name} failed ({out.returncode}): {out.stderr[-2000:]}")
    summary = json.loads((folder / "runs" / config.name / "summary.json").read_text())
    return {"memory": summary["memory"], "seconds": time.perf_counter() - start}


@dataclass
class Result:
    config: Config
    estimate: dict
    measured_mib: float
    seconds: float

    @property
    def stage(self) -> dict:
        return self.estimate["stages"][0]

    @property
    def estimate_mib(self) -> float:
        return self.stage["mib"]["total"]

    @property
    def error(self) -> float:
        return (self.estimate_mib - self.measured_mib) / self.measured_mib


def run_all(configs: list[Config], folder: Path, jobs: int = 2) -> list[Result]:
    """Estimate every configuration (``jobs`` at a time: an estimate is mostly imports), then
    run them one at a time: two trainings side by side on a small machine oversubscribe its
    cores (OpenMP spins), ten times slower, and memory is per process either way."""
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        estimates = list(pool.map(lambda c: estimate(c, folder), configs))
    results = []
    for config, est in zip(configs, estimates):
        got = measure(config, folder)
        results.append(Result(config, est, got["memory"]["train: trained"]["peak_rss_mib"], got["seconds"]))
    return results


def table(results: list[Result]) -> str:
    lines = [f"{'configuration':18} {'method':22} {'weights':>8} {'grads':>7} {'optim':>7} {'activ':>7} "
             f"{'overhd':>7} {'estimate':>9} {'measured':>9} {'error':>7}",
             "-" * 106]
    for r in results:
        c, m = r.config, r.stage["mib"]
        name = c.adapter.split('"')[1] if '"' in c.adapter else c.adapter
        method = f"{name}{'+ckpt' if r.stage['gradient_checkpointing'] else ''}" + (
            f" {c.quantizer}" if c.quantizer != "none" else "") + f" {c.trainer}"
        lines.append(f"{c.name:18} {method:22} {m['weights']:8.0f} {m['gradients']:7.0f} {m['optimizer']:7.0f} "
                     f"{m['activations']:7.0f} {m['overhead']:7.0f} {r.estimate_mib:9.0f} {r.measured_mib:9.0f} "
                     f"{100 * r.error:+6.1f}%")
    lines.append("(MiB; estimate: `ftcore estimate --json --device cpu`; measured: the run's peak RSS while "
                 "training)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="configuration names (default: all of them)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--keep", help="project folder to use and keep (default: a temporary one)")
    args = parser.parse_args()
    configs = [c for c in CONFIGS + EXTRA + METHODS if not args.only or c.name in args.only]
    folder = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="ftcore-memory-"))
    write_project(folder, hf_model=any(c.model == "small-hf" for c in configs))
    start = time.perf_counter()
    results = run_all(configs, folder, jobs=args.jobs)
    print(table(results))
    for r in results:
        for note in r.stage["notes"]:
            print(f"{r.config.name}: note: {note}")
    print(f"{len(results)} configurations in {time.perf_counter() - start:.0f}s ({args.jobs} at a time); "
          f"project: {folder}")


if __name__ == "__main__":
    main()
