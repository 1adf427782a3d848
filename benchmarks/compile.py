"""``compile = true`` against eager: step time, compile time and losses over the same steps.

    python benchmarks/compile.py [--config tiny qwen25-05b] [--steps 20] [--tiny]

Each arm runs in its own process: the config's model (``loss_kernels.py``'s configs, random init,
LoRA r=16 on every linear layer, fp32), ftcore's default loss (the chunked kernel) and AdamW
(lr 1e-3), ``--steps`` steps over the same batches. The compiled arm compiles the decoder blocks as
``compile = true`` does (``plugins/trainers/_compile.py``: torch.compile, inductor's CPU code).
Reports the median step time after the first two steps, the first step's time (the compile time
is what it takes beyond an eager step), and the largest difference between the arms' losses at any
step (the issue's bound: 1e-4). Each arm gets an empty inductor cache, so the compile is cold.
``--tiny`` is the test's mode: the tiny config, 4 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def arm(config_name: str, compiled: bool, steps: int) -> dict:
    import torch

    from ftcore_plugins.trainers._compile import compiled_blocks
    from ftcore_plugins.trainers._loss import add_chunked_head
    from loss_kernels import lora_model, token_batch

    model, params = lora_model(config_name)
    add_chunked_head(model, entropy=False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    losses, times = [], []
    with compiled_blocks(model, compiled) as blocks:
        for step in range(steps):
            batch = token_batch(config_name, seed=step)
            start = time.perf_counter()
            out = model(**batch, use_cache=False, chunked_loss=True)
            loss = out.loss / out.tokens
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
    return {"config": config_name, "compiled": compiled, "blocks": blocks, "params": params, "losses": losses,
            "first_s": times[0], "step_s": statistics.median(times[2:]) if len(times) > 2 else times[-1]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", nargs="+", default=["tiny", "qwen25-05b"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--tiny", action="store_true", help="the tiny config, 4 steps (the test's mode)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--arm", nargs=2, metavar=("CONFIG", "COMPILED"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.arm:
        print(json.dumps(arm(a.arm[0], a.arm[1] == "1", a.steps)))
        return
    configs, steps = (["tiny"], 4) if a.tiny else (a.config, a.steps)
    from _bench import machine

    rows = []
    for config in configs:
        runs = {}
        for compiled in (False, True):
            with tempfile.TemporaryDirectory() as cache:  # a cold compile: inductor caches on disk across runs
                out = subprocess.run([sys.executable, __file__, "--arm", config, str(int(compiled)), "--steps",
                                      str(steps)], capture_output=True, text=True,
                                     env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache})
            if out.returncode:
                sys.exit(f"{config} {'compiled' if compiled else 'eager'} arm failed:\n{out.stderr[-3000:]}")
            runs[compiled] = json.loads(out.stdout.strip().splitlines()[-1])
        eager, comp = runs[False], runs[True]
        rows.append({"config": config, "params": eager["params"], "blocks": comp["blocks"],
                     "eager_step_s": eager["step_s"], "compiled_step_s": comp["step_s"],
                     "ratio": comp["step_s"] / eager["step_s"], "compile_s": comp["first_s"] - eager["first_s"],
                     "max_loss_diff": max(abs(x - y) for x, y in zip(eager["losses"], comp["losses"])),
                     "steps": steps, "last_loss": eager["losses"][-1]})
    print(f"machine: {machine()}")
    print()
    print("| config | parameters | blocks compiled | eager step (s) | compiled step (s) | ratio compiled/eager | "
          "compile time (s) | largest loss difference |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['config']} | {r['params'] / 1e6:.1f}M | {r['blocks']} | {r['eager_step_s']:.3f} | "
              f"{r['compiled_step_s']:.3f} | {r['ratio']:.2f} | {r['compile_s']:.1f} | {r['max_loss_diff']:.1e} |")
    print(f"({steps} steps per arm; step times are medians after the first two steps)")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
