"""Memory of a LoRA on a mixture-of-experts layer's routed experts: peft's path against ftcore's grouped one.

    python benchmarks/expert_lora_memory.py [--tokens 512] [--rank 16] [--dtypes bfloat16 float32] [--tiny]

One mixture-of-experts block of Qwen3-30B-A3B's size (transformers' ``Qwen3MoeSparseMoeBlock``: 128
experts, hidden 2048, moe_intermediate_size 768, 8 experts a token; random weights, its router and
experts frozen; transformers' default ``grouped_mm`` experts forward), one forward and backward over
``--tokens`` tokens, each arm in a process of its own:

- ``frozen``: no adapter; the gradient flows to the block's input only.
- ``peft``: LoRA of rank ``--rank`` on ``experts.gate_up_proj`` and ``experts.down_proj`` through
  peft's ``target_parameters`` (``ParamWrapper``), with ftcore's grouped forward switched off
  (``expert_lora.disable``): while the block runs, the parameter reads as ``W + s B A`` for every
  expert at once (one ``baddbmm`` over the whole expert stack), which the experts' matmuls then read
  and save.
- ``grouped``: the same peft adapter with ftcore's grouped forward on, as the ``lora`` adapter applies
  it (``plugins/common/expert_lora.py``, ``enable``): each projection is the frozen weight's grouped
  matmul plus ``s (x A^T) B^T`` per expert on its own tokens, over transformers' ``_grouped_linear``.

The two LoRA arms start from the same nonzero factors; their outputs and gradients (the input's, the
factors') are compared. Measured, after the same step on a tiny block (one-off set-up): the peak RSS
of the step above the RSS before it (VmHWM after ``ftcore.memory.reset_peak``), and the bytes the
forward saves for backward beyond the weights, the factors and the input
(``torch.autograd.graph.saved_tensors_hooks``, each storage once). Against both, what ``ftcore
estimate`` counts for the path each arm runs (``_expert_lora`` and ``expert_lora_bytes`` in
plugins/common/estimate.py).

``--tiny`` (the test's mode): 8 experts, hidden 64, moe_intermediate_size 32, 2 a token, 64 tokens,
rank 4, float32, the arms one after another in one process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from _bench import machine  # noqa: E402

MiB = 2**20
REAL = {"num_experts": 128, "hidden_size": 2048, "moe_intermediate_size": 768, "num_experts_per_tok": 8}
TINY = {"num_experts": 8, "hidden_size": 64, "moe_intermediate_size": 32, "num_experts_per_tok": 2}
PARAMETERS = ("gate_up_proj", "down_proj")
ARMS = ("frozen", "peft", "grouped")


def block(sizes: dict, dtype):
    """The MoE block, its weights drawn from a fixed seed, everything frozen."""
    import torch
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = AutoConfig.for_model("qwen3_moe", num_attention_heads=4, num_key_value_heads=4, **sizes)
    config._experts_implementation = "grouped_mm"  # what from_pretrained/from_config choose by default
    torch.manual_seed(0)
    moe = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.02)
    moe = moe.to(dtype)
    moe.requires_grad_(False)
    return moe


def factors(experts, rank: int, dtype) -> dict:
    """{parameter: (A, B)}: per expert A (experts x rank x in) and B (experts x out x rank), fixed seed, B not
    zero so that the adapter changes the output."""
    import torch

    g = torch.Generator().manual_seed(1)
    out = {}
    for name in PARAMETERS:
        e, o, i = getattr(experts, name).shape  # transformers stores experts x out x in
        out[name] = (torch.randn(e, rank, i, generator=g) / i ** 0.5, torch.randn(e, o, rank, generator=g) * 0.02)
    return {k: (a.to(dtype), b.to(dtype)) for k, (a, b) in out.items()}


def arm(name: str, sizes: dict, tokens: int, rank: int, dtype_name: str) -> dict:
    """One arm's step, after the same step on a tiny block: the first call's one-off allocations (kernels' and
    autograd's lazy set-up) are not the arm's."""
    measure(name, TINY, 16, rank, dtype_name)
    return measure(name, sizes, tokens, rank, dtype_name)


def measure(name: str, sizes: dict, tokens: int, rank: int, dtype_name: str) -> dict:
    import torch

    from ftcore import memory

    dtype = getattr(torch, dtype_name)
    moe = block(sizes, dtype)
    experts = moe.experts
    weight_bytes = sum(getattr(experts, n).numel() * getattr(experts, n).element_size() for n in PARAMETERS)
    scaling = 2.0  # lora_alpha = 2r
    trained: list = []
    counted = None  # what ftcore estimate counts for this block's step, for the path the arm runs
    if name != "frozen":
        from peft import LoraConfig, inject_adapter_in_model

        from ftcore_plugins.common import expert_lora
        from ftcore_plugins.common.estimate import _scan, expert_lora_bytes

        pairs = factors(experts, rank, dtype)
        moe = inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=[],
                                                 target_parameters=[f"experts.{n}" for n in PARAMETERS]), moe)
        wrappers = {m.parameter_name: m for m in moe.modules() if type(m).__name__ == "ParamWrapper"}
        assert set(wrappers) == set(PARAMETERS), wrappers
        with torch.no_grad():
            for n, (a, b) in pairs.items():
                w = wrappers[n]
                e, r, i = a.shape
                w.lora_A["default"].weight.copy_(a.reshape(e * r, i))  # peft's layout: (experts x rank) x in
                # out x (rank x experts)
                w.lora_B["default"].weight.copy_(b.permute(1, 2, 0).reshape(b.shape[1], r * e))
                assert w.scaling["default"] == scaling
        trained = [(f"{n}.{part}", getattr(wrappers[n], f"lora_{part}")["default"].weight) for n in PARAMETERS
                   for part in "AB"]
        assert expert_lora.enable(moe) == 2  # what the lora adapter does once peft has wrapped the model
        if name == "peft":
            expert_lora.disable(moe)
        assert [expert_lora.runs_grouped(w) for w in wrappers.values()] == [name == "grouped"] * 2
        moe.config = experts.config  # where the estimate reads how many experts a token uses
        found = _scan(moe, autocast=False)
        counted = {"copies": expert_lora_bytes(found["expert_blocks"], True), "inputs": tokens * found["expert_inputs"]}
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, tokens, sizes["hidden_size"], generator=g).to(dtype).requires_grad_(True)
    target = torch.randn(1, tokens, sizes["hidden_size"], generator=g).to(dtype)
    existing = {t.untyped_storage().data_ptr() for t in [*moe.parameters(), *(p for _, p in trained), x, target]}
    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in existing:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    memory.release()
    before = memory.snapshot()["rss_mib"]
    memory.reset_peak()
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = moe(x)
    loss = (y.float() - target.float()).pow(2).mean()
    loss.backward()
    seconds = time.perf_counter() - start
    peak = memory.snapshot()["peak_rss_mib"]
    # The factors' gradients in one layout (A: experts x rank x in, B: experts x out x rank), for the comparison.
    grads = {}
    for label, p in trained:
        grad = p.grad.float()
        e = sizes["num_experts"]
        grad = grad.reshape(e, -1, grad.shape[-1]) if label.endswith("A") else \
            grad.reshape(grad.shape[0], -1, e).permute(2, 0, 1)
        grads[label] = grad.flatten().tolist() if tokens * sizes["hidden_size"] <= 4096 else None
        grads[label + " norm"] = grad.norm().item()
    return {"arm": name, "dtype": dtype_name, "tokens": tokens, "rank": rank, **sizes,
            "expert_bytes": weight_bytes, "saved_bytes": sum(saved.values()), "estimate_bytes": counted,
            "peak_above_mib": peak - before, "seconds": seconds, "loss": loss.item(),
            "output_norm": y.float().norm().item(), "input_grad_norm": x.grad.float().norm().item(), "grads": grads}


def agree(a: dict, b: dict, rel: float) -> float:
    """The largest relative difference between two LoRA arms: loss, output, the input's gradient, the factors'."""
    keys = [k for k in a["grads"] if k.endswith("norm")]
    pairs = [(a[k], b[k]) for k in ("loss", "output_norm", "input_grad_norm")] + [(a["grads"][k], b["grads"][k])
                                                                                   for k in keys]
    worst = max(abs(x - y) / max(abs(x), abs(y), 1e-12) for x, y in pairs)
    if worst > rel:
        sys.exit(f"peft's path and the grouped one disagree ({worst:.2e} > {rel:g}): {a} {b}")
    return worst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--dtypes", nargs="+", choices=["bfloat16", "float32"], default=["bfloat16", "float32"])
    p.add_argument("--tiny", action="store_true", help="8 experts, hidden 64, 64 tokens, rank 4 (the test's mode)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--arm", help=argparse.SUPPRESS)
    a = p.parse_args()
    sizes = TINY if a.tiny else REAL
    tokens, rank, dtypes = (64, 4, ["float32"]) if a.tiny else (a.tokens, a.rank, a.dtypes)
    if a.arm:
        name, dtype = a.arm.split(":")
        print(json.dumps(arm(name, sizes, tokens, rank, dtype)))
        return
    results = []
    for dtype in dtypes:
        for name in ARMS:
            if a.tiny:  # one process: its imports are most of the test's time, and tiny peaks are noise anyway
                results.append(arm(name, sizes, tokens, rank, dtype))
                continue
            # At the real size each arm runs in a fresh process, so that its peak is its own.
            cmd = [sys.executable, __file__, "--arm", f"{name}:{dtype}", "--tokens", str(tokens), "--rank", str(rank)]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{name} ({dtype}) failed:\n{out.stderr[-3000:]}")
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    for dtype in dtypes:
        by = {r["arm"]: r for r in results if r["dtype"] == dtype}
        by["grouped"]["agreement"] = agree(by["peft"], by["grouped"], 2e-2 if dtype == "bfloat16" else 1e-4)
    s = sizes
    print(f"machine: {machine()}")
    print(f"one MoE block: {s['num_experts']} experts, hidden {s['hidden_size']}, moe_intermediate_size "
          f"{s['moe_intermediate_size']}, {s['num_experts_per_tok']} a token; {tokens} tokens, LoRA r={rank} on "
          "experts.gate_up_proj and experts.down_proj")
    print("| dtype | arm | expert weights (MiB) | saved for backward (MiB) | peak above start (MiB) | seconds |")
    print("|---|---|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['dtype']} | {r['arm']} | {r['expert_bytes'] / MiB:,.1f} | {r['saved_bytes'] / MiB:,.1f} | "
              f"{r['peak_above_mib']:,.1f} | {r['seconds']:.2f} |")
    for r in results:
        if "agreement" in r:
            print(f"{r['dtype']}: peft and grouped agree within {r['agreement']:.1e} (loss, output, gradients)")
    for dtype in dtypes:
        by = {r["arm"]: r for r in results if r["dtype"] == dtype}
        for name, copies in (("peft", "W + s B A copies and a gradient"), ("grouped", "the factors' copies")):
            counted = by[name]["estimate_bytes"]
            above = by[name]["peak_above_mib"] - by["frozen"]["peak_above_mib"]
            print(f"{dtype}: {name}'s peak above the frozen experts': {above:,.1f} MiB; ftcore estimate counts "
                  f"{(counted['copies'] + counted['inputs']) / MiB:,.1f} MiB ({copies} {counted['copies'] / MiB:,.1f}, "
                  f"the matmuls' inputs {counted['inputs'] / MiB:,.1f})")
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
