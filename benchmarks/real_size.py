"""A 0.5B-class model end to end on CPU: LoRA and QLoRA SFT, perplexity, merged/adapter/GGUF exports.

    python benchmarks/real_size.py [--steps 5] [--max-length 512] [--batch 2] [--tiny]

The model has Qwen2.5-0.5B's exact config (hidden 896, 24 layers, 14 heads, 2 KV heads,
intermediate 4864, tied embeddings, vocabulary 151,936) with random weights, saved in bf16 as
the real checkpoint is, next to the real Qwen2.5 tokenizer (../shared/fixtures/tokenizers/qwen25):
nothing is downloaded. Two plans run on it, each with ``ftcore run`` in a process of its own:

* **lora**: LoRA r=16 on every linear layer, SFT on the real Alpaca demo packed into rows of
  ``max_length`` (so a step's tokens are known: batch x max_length), fp32, perplexity before and after on 64 held-out rows, then adapter, merged and GGUF (q8_0)
  exports;
* **qlora**: the same with the base quantized to nf4 (bitsandbytes), then a merged export
  (into the base reloaded at full precision).

Per phase it reports the measured peak RSS (the run's own ``summary.json`` memory points,
VmHWM since the phase began) against ``ftcore estimate``'s prediction for the training
phases, the export peaks against the model's size in memory plus the process baseline, and the
step times. The time model: ``ftcore estimate --gpu cpu`` (this machine's fp32 matmul rate,
measured) predicts the LoRA step time from the stage's FLOPs per token; the error against the
measured median step is printed.

``--tiny`` (the test's mode): the same config cut to 2 layers and hidden 64, 2 steps at
max_length 64.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from _bench import SHARED, machine  # noqa: E402

QWEN = SHARED / "tokenizers" / "qwen25"
ALPACA = SHARED / "data" / "alpaca_en_demo.json"
QWEN25_05B = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
              "intermediate_size": 4864, "vocab_size": 151936, "max_position_embeddings": 32768,
              "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "hidden_act": "silu"}
TINY = {**QWEN25_05B, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128}
MiB = 2**20

PLAN = """
[run]
name = "{name}"
seed = 3

[model]
use = "hf"
path = "model"
dtype = "float32"
{quantizer}
[template]
use = "native"

[adapter]
use = "lora"
r = 16
lora_alpha = 32

[data.alpaca]
use = "json"
path = "{alpaca}"
validation = 64

[[stage]]
name = "sft"
trainer = "sft"
data = "alpaca:train"
max_length = {max_length}
max_steps = {steps}
batch_size = {batch}
packing = true
learning_rate = 2e-4
logging_steps = 1
save_steps = 100000

[[evaluate]]
use = "perplexity"
data = "alpaca:validation"
max_length = {max_length}
{exports}"""

EXPORTS = {
    "lora": '\n[[export]]\nuse = "adapter"\n\n[[export]]\nuse = "merged"\n\n[[export]]\nuse = "gguf"\ntypes = ["q8_0"]\n',
    "qlora": '\n[[export]]\nuse = "merged"\n',
}


def build_model(folder: Path, fields: dict) -> int:
    """Qwen2.5-0.5B's config (or ``fields``) with random weights, saved in bf16 with the real tokenizer;
    returns the parameter count."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(QWEN)
    config = AutoConfig.for_model("qwen2", **fields, bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
                                  eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "ftcore", *args], cwd=cwd, capture_output=True, text=True,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if out.returncode not in (0, 1):  # estimate exits 1 when a budget is not met; none is given here
        sys.exit(f"ftcore {' '.join(args)} failed:\n{out.stderr[-4000:]}")
    return out


def step_times(run: Path, stage: str) -> list[float]:
    """Seconds between consecutive logged training steps (logging_steps = 1)."""
    logs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    stamps = [m["time"] for m in logs if m.get("stage") == stage and "loss" in m and m.get("step")]
    return [b - a for a, b in zip(stamps, stamps[1:])]


def run_plan(work: Path, kind: str, a: argparse.Namespace) -> dict:
    quantizer = '\n[quantizer]\nuse = "bnb-nf4"\n' if kind == "qlora" else ""
    plan = work / f"{kind}.toml"
    plan.write_text(PLAN.format(name=kind, quantizer=quantizer, alpaca=ALPACA, max_length=a.max_length,
                                steps=a.steps, batch=a.batch, exports=EXPORTS[kind]))
    predicted = json.loads(cli("estimate", str(plan), "--json", cwd=work).stdout)
    timed = json.loads(cli("estimate", str(plan), "--json", "--gpu", "cpu", cwd=work).stdout)["compute"]
    cli("run", str(plan), cwd=work)
    run = work / "runs" / kind
    summary = json.loads((run / "summary.json").read_text())
    steps = {s["name"]: s["seconds"] for s in summary["steps"]}
    times = step_times(run, "sft")
    stage = timed["stages"][0]
    tokens_per_step = stage["tokens"] / a.steps
    return {"kind": kind, "memory": summary["memory"], "steps": steps, "step_times": times,
            "estimate_mib": predicted["stages"][0]["mib"]["total"],
            "weights_mib": predicted["stages"][0]["mib"]["weights"],
            "perplexity": {p: summary["evaluations"][p]["perplexity"]["perplexity"] for p in ("before", "after")},
            "flops_per_token": stage["flops_per_token"], "tokens_per_step": tokens_per_step,
            "cpu_flops": timed["peak_flops"],
            "predicted_step_s": stage["flops_per_token"] * tokens_per_step / timed["peak_flops"],
            "train_tokens": summary["stages"]["sft"].get("train_tokens")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--only", choices=("lora", "qlora"), help="run one plan")
    p.add_argument("--tiny", action="store_true", help="2 layers, hidden 64, 2 steps at 64 tokens (the test's mode)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--keep", type=Path, help="work here and keep the folder")
    a = p.parse_args()
    if not (QWEN.exists() and ALPACA.exists()):
        sys.exit(f"needs the real Qwen2.5 tokenizer and the Alpaca demo in {SHARED}")
    if a.tiny:
        a.steps, a.max_length = 2, 64
    with tempfile.TemporaryDirectory(prefix="ftcore-real-size-") as tmp:
        work = a.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        params = build_model(work / "model", TINY if a.tiny else QWEN25_05B)
        results = [run_plan(work, kind, a) for kind in (("lora", "qlora") if a.only is None else (a.only,))]
    size_mib = params * 4 / MiB  # fp32 in memory, as trained
    print(f"machine: {machine()}")
    print(f"model: Qwen2.5-0.5B's config{' cut to 2 layers, hidden 64' if a.tiny else ''}, {params:,} parameters, "
          f"{size_mib:,.0f} MiB in fp32; {a.steps} steps of batch {a.batch} at max_length {a.max_length}")
    print()
    print("| plan | phase | seconds | peak RSS (MiB) | predicted (MiB) | error | RSS before (MiB) | "
          "bound (MiB) | peak / bound |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        mem, base = r["memory"], r["memory"]["baseline"]["rss_mib"]
        load = mem["model loaded"]["peak_rss_mib"]
        print(f"| {r['kind']} | load | {r['steps'].get('load', 0):.1f} | {load:,.0f} | | | {base:,.0f} | | |")
        trained = mem["sft: trained"]["peak_rss_mib"]
        error = trained / r["estimate_mib"] - 1
        print(f"| {r['kind']} | train ({len(r['step_times']) + 1} steps) | {r['steps']['sft']:.1f} | {trained:,.0f} | "
              f"{r['estimate_mib']:,.0f} | {error:+.1%} | | | |")
        # The model the run holds: its weights as loaded (fp32 for LoRA; 4-bit linear layers with the fp32
        # embedding for QLoRA), as `ftcore estimate` counts them from the config.
        held = r["weights_mib"]
        for point, values in mem.items():
            if point.startswith("export:"):
                # The process baseline: its RSS when the export began less the model it held (heap that
                # training freed but the allocator kept is in both the baseline and the peak); the bound
                # adds 1.3x the exported model, fp32.
                peak, start = values["peak_rss_mib"], values["rss_before_mib"]
                bound = start - held + 1.3 * size_mib
                print(f"| {r['kind']} | {point} | {r['steps'].get(point, 0):.1f} | {peak:,.0f} | | | {start:,.0f} | "
                      f"{bound:,.0f} | {peak / bound:.2f} |")
    print()
    for r in results:
        median = statistics.median(r["step_times"]) if r["step_times"] else float("nan")
        print(f"{r['kind']}: step time median {median:.2f} s over {len(r['step_times'])} steps (the first, with "
              f"warm-up, not counted); perplexity {r['perplexity']['before']:,.1f} -> {r['perplexity']['after']:,.1f}")
        if r["kind"] == "lora":
            print(f"time model: {r['flops_per_token'] / 1e9:.3f} GFLOPs/token x {r['tokens_per_step']:,.0f} tokens/step "
                  f"/ {r['cpu_flops'] / 1e9:.1f} GFLOP/s measured = {r['predicted_step_s']:.2f} s predicted, "
                  f"{median:.2f} s measured: error {r['predicted_step_s'] / median - 1:+.1%}")
    if a.json:
        a.json.write_text(json.dumps({"params": params, "size_mib": size_mib, "results": results}, indent=1))


if __name__ == "__main__":
    main()
