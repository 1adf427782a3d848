"""The three ``loss_kernel``s of sft/pretrain side by side: step time and peak memory of one
training forward + backward (LoRA r=16 on every linear layer, fp32), each arm in its own process.

    python benchmarks/loss_kernels.py [--config llama3-68m qwen25-05b] [--repeats 3] [--steps 3] [--tiny]

Configs (random init, nothing downloaded):
- ``llama3-68m``: the Llama of issue #16's peer comparison (68.9M parameters, Llama 3's 128,256-token
  vocabulary), batch 4 x 256 tokens, the first 40% of each row a prompt (not trained).
- ``qwen25-05b``: Qwen2.5-0.5B's exact config (151,936 tokens, tied embeddings), batch 4 x 512.

Per arm: the median step time over ``--steps`` steps after one warm-up step, and the peak RSS
during the steps above the RSS before them (``ftcore.memory``: VmHWM reset by clear_refs).
Arms alternate within each repeat, so a slower moment of the machine falls on all of them.
``--grads`` also saves each arm's LoRA gradients of the first step and prints the largest
difference from the full loss's. ``--tiny`` is the test's mode: a small model, one repeat, one step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

KERNELS = ("full", "trl", "chunked")
CONFIGS = {
    "llama3-68m": dict(arch="llama", vocab_size=128256, hidden_size=256, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=4, intermediate_size=1024, tie_word_embeddings=False, rows=4, length=256),
    "qwen25-05b": dict(arch="qwen2", vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True, rows=4, length=512,
                       max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "tiny": dict(arch="llama", vocab_size=4096, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, intermediate_size=128, tie_word_embeddings=False, rows=2, length=64),
}


def lora_model(config_name: str) -> tuple[Any, int]:
    """The config's model (random init, seed 0, fp32) with LoRA r=16 on every linear layer, in
    training mode, and the base model's parameter count."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    spec = {k: v for k, v in CONFIGS[config_name].items() if k not in ("arch", "rows", "length")}
    arch = CONFIGS[config_name]["arch"]
    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[arch]
    model_cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}[arch]
    torch.manual_seed(0)
    model = model_cls(config_cls(**spec)).float()
    params = sum(p.numel() for p in model.parameters())
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    return model.train(), params


def token_batch(config_name: str, seed: int = 1) -> dict:
    """The config's batch of random tokens (``seed``), the first 40% of each row a prompt."""
    import torch

    spec = CONFIGS[config_name]
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, spec["vocab_size"], (spec["rows"], spec["length"]), generator=g)
    labels = ids.clone()
    labels[:, : int(0.4 * spec["length"])] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def arm(config_name: str, kernel: str, steps: int, grads: Path | None = None) -> dict:
    """One arm, in this process: build the model, take 1 + ``steps`` forward/backward steps; with
    ``grads``, save the first step's trainable gradients there (safetensors)."""
    from ftcore import memory
    from ftcore_plugins.trainers._loss import add_chunked_head, full_cross_entropy

    model, params = lora_model(config_name)
    batch = token_batch(config_name)
    labels = batch["labels"]
    if kernel == "chunked":
        add_chunked_head(model, entropy=False)
    elif kernel == "trl":
        from trl.trainer.utils import add_fused_lm_head

        # As trl.SFTTrainer installs it, with the outputs its metrics read.
        add_fused_lm_head(model.get_base_model(), outputs=("log_probs", "entropy", "is_top1"))

    def step(keep: Path | None = None) -> float:
        if kernel == "full":
            out = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False)
            loss = full_cross_entropy(out, labels)
        elif kernel == "chunked":
            out = model(**batch, use_cache=False, chunked_loss=True)
            loss = out.loss / out.tokens
        else:
            out = model(**batch, use_cache=False, fused_lm_head=True)
            loss = -out.log_probs.sum() / out.label_mask.sum()
        loss.backward()
        if keep is not None:
            from safetensors.torch import save_file

            save_file({n: p.grad.contiguous() for n, p in model.named_parameters() if p.requires_grad}, str(keep))
        model.zero_grad(set_to_none=True)
        return loss.item()

    loss = step(grads)  # warm-up
    before = memory.snapshot()["rss_mib"]
    memory.reset_peak()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    peak = memory.snapshot()["peak_rss_mib"]
    return {"config": config_name, "kernel": kernel, "params": params, "loss": loss,
            "step_s": statistics.median(times), "peak_above_mib": peak - before, "peak_rss_mib": peak}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", nargs="+", default=["llama3-68m", "qwen25-05b"], choices=sorted(CONFIGS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="a small model, one repeat, one step (the test's mode)")
    p.add_argument("--arm", nargs=2, metavar=("CONFIG", "KERNEL"), help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--grads", action="store_true",
                   help="also compare each arm's LoRA gradients of the first step with the full loss's")
    p.add_argument("--grads-file", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.arm:
        print(json.dumps(arm(a.arm[0], a.arm[1], a.steps, a.grads_file)))
        return
    configs, repeats, steps = (["tiny"], 1, 1) if a.tiny else (a.config, a.repeats, a.steps)
    results: dict[tuple[str, str], list[dict]] = {}
    tmp = Path(tempfile.mkdtemp(prefix="ftcore-loss-kernels-"))
    for config in configs:
        for r in range(repeats):
            order = KERNELS if r % 2 == 0 else KERNELS[::-1]
            for kernel in order:
                extra = ["--grads-file", str(tmp / f"{config}-{kernel}.safetensors")] if a.grads and r == 0 else []
                out = subprocess.run([sys.executable, __file__, "--arm", config, kernel, "--steps", str(steps), *extra],
                                     capture_output=True, text=True, check=True)
                results.setdefault((config, kernel), []).append(json.loads(out.stdout.strip().splitlines()[-1]))
    grad_diff = {}
    if a.grads:
        from safetensors.torch import load_file

        for config in configs:
            ref = load_file(str(tmp / f"{config}-full.safetensors"))
            for kernel in KERNELS:
                mine = load_file(str(tmp / f"{config}-{kernel}.safetensors"))
                grad_diff[(config, kernel)] = max((mine[k] - ref[k]).abs().max().item() for k in ref)
    shutil.rmtree(tmp, ignore_errors=True)
    rows = []
    for (config, kernel), runs in results.items():
        rows.append({"config": config, "kernel": kernel, "params": runs[0]["params"], "loss": runs[0]["loss"],
                     "max_grad_diff": grad_diff.get((config, kernel)),
                     "step_s": statistics.median(r["step_s"] for r in runs),
                     "peak_above_mib": statistics.median(r["peak_above_mib"] for r in runs)})
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    print(f"{'config':<12} {'kernel':<8} {'loss':>9} {'step s':>8} {'x full':>7} {'x trl':>7} "
          f"{'peak MiB':>9} {'x full':>7}" + (f" {'grad diff':>10}" if a.grads else ""))
    for row in rows:
        ref = {r["kernel"]: r for r in rows if r["config"] == row["config"]}
        print(f"{row['config']:<12} {row['kernel']:<8} {row['loss']:>9.5f} {row['step_s']:>8.3f} "
              f"{row['step_s'] / ref['full']['step_s']:>7.2f} {row['step_s'] / ref['trl']['step_s']:>7.2f} "
              f"{row['peak_above_mib']:>9.0f} {row['peak_above_mib'] / max(ref['full']['peak_above_mib'], 1):>7.2f}"
              + (f" {row['max_grad_diff']:>10.2e}" if row["max_grad_diff"] is not None else ""))


if __name__ == "__main__":
    main()
