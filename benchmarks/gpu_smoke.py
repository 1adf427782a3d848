"""The GPU smoke check: what must hold before a lent GPU's minutes go to measuring, in one command of
under 4 minutes. Run it first on a GPU, then ``gpu_throughput.py --quick``:

    source .device/setup.sh && python3 benchmarks/gpu_smoke.py --jsonl $OUT/smoke.jsonl   # on the GPU
    python benchmarks/gpu_smoke.py --tiny         # on a CPU: every check a CPU runs, the rest "skipped: no GPU"

Each check prints one line as it finishes (``ok``, ``FAILED: why`` or ``skipped: why``) and writes a JSON
line (``--jsonl``); the exit status is 1 when any failed. The checks, in order:

1. ``c-compiler``: Triton (flex attention's and Liger's kernels) builds a C launcher for each kernel,
   with ``$CC``, gcc or clang (``device_defaults.triton_problem``).
2. ``triton-launcher``: a one-line Triton kernel compiled, launched and its result checked (GPU only).
3. ``defaults``: the stage's choices for this device (``SFT.device_choices``, from the device it trains
   on, with the model still on the CPU as the ``hf`` loader leaves it) are the first of
   ``device_defaults.py``'s that run here: packed attention, loss kernel, chunk size, optimizer.
4. Training arms, 5 steps each, of a tiny Llama (2 layers, hidden 128, head_dim 32) around the real
   Llama 3 tokenizer (128,256 tokens; ../shared/fixtures, else the run says which it used), through
   ``ftcore run``: LoRA, full and QLoRA (bnb-nf4), packed and unpacked, with every ``auto`` default, and
   ``packed_attention = "sdpa_block"``, ``loss_kernel = "chunked"``, ``liger = true`` and
   ``optimizer = "adamw_torch_fused"`` spelled out; on a GPU, LoRA on hqq, torchao (int8, int4, float8),
   quanto int4 and fp8 weights too, and QAT (int4 weights, full and LoRA). Each arm: the run ends, every
   logged loss is finite, and what an ``auto`` arm chose (``loss_kernel``, ``packed_attention``, ``optimizer`` in its
   metrics) is the device's default. Each arm is a fork of this process: no patch (Liger's) or compiled
   graph leaks from one arm into the next.
5. ``packed-equals-unpacked``: the same 12 samples, as padded rows and as packed bins through each packed
   path this device runs: the summed loss and the LM head's gradient agree within the precision's
   tolerance (bf16 on a GPU: 2e-2 and 5e-2 relative; fp32: 1e-4).
6. ``pytest -m gpu``: the CUDA-only tests (GPU only; needs pytest on the machine).

Nothing is written in the repository; models and runs live in a temporary folder, removed at exit.
"""

from __future__ import annotations

import time

START = time.monotonic()

import argparse  # noqa: E402
import atexit  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import HF_SFT_PLAN, PRELOAD, ROOT, SHARED, in_child, machine, preload, probe, quiet, \
    run_ftcore  # noqa: E402

STEPS = 5
CONFIG = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=256, max_position_embeddings=1024, tie_word_embeddings=True)
# name: (method, packing, extra stage lines, cuda only, whether every auto default is checked)
ARMS = {
    "lora-packed": ("lora", True, "", False, True),
    "lora-unpacked": ("lora", False, "", False, True),
    "lora-packed-sdpa_block": ("lora", True, 'packed_attention = "sdpa_block"', False, False),
    "lora-packed-chunked": ("lora", True, 'loss_kernel = "chunked"', False, False),
    "lora-fused-adamw": ("lora", False, 'optimizer = "adamw_torch_fused"', False, False),
    "full-packed": ("full", True, "", False, True),
    "full-unpacked": ("full", False, "", False, True),
    "qlora-packed": ("qlora", True, "", False, True),
    "qlora-unpacked": ("qlora", False, "", False, True),
    "lora-packed-liger": ("lora", True, "liger = true", True, False),  # Liger's layer kernels: CUDA only
    # LoRA on the other quantizers (issue #44). tests/test_quantizer_methods.py trains the ones a CPU runs;
    # here they run on the GPU only, beside the CUDA-only types.
    "hqq-unpacked": ("hqq", False, "", True, False),
    "torchao-int8-unpacked": ("torchao-int8", False, "", True, False),
    "torchao-int4-unpacked": ("torchao-int4", False, "", True, False),
    "torchao-float8-unpacked": ("torchao-float8", False, "", True, False),
    "quanto-int4-unpacked": ("quanto-int4", False, "", True, False),
    "fp8-unpacked": ("fp8", False, "", True, False),
    # QAT (torchao's fake-quantized int4 weights, issue #44): tests/test_qat.py trains it on a CPU.
    "full-qat-unpacked": ("full", False, 'qat = { weights = "int4", group_size = 32 }', True, False),
    "lora-qat-unpacked": ("lora", False, 'qat = { weights = "int4", group_size = 32, activations = "int8" }', True,
                          False),
}
# Each quantized method's [quantizer] table.
QUANTIZERS = {"qlora": 'use = "bnb-nf4"', "hqq": 'use = "hqq"', "torchao-int8": 'use = "torchao"',
              "torchao-int4": 'use = "torchao"\nweights = "int4"', "torchao-float8": 'use = "torchao"\nweights = "float8"',
              "quanto-int4": 'use = "quanto"\nweights = "int4"', "fp8": 'use = "fp8"'}
class Checks:
    """Each check's line on stdout and in the JSON lines, as it finishes; failures counted."""

    def __init__(self, jsonl: Path | None):
        self.fh = open(jsonl, "w", encoding="utf-8") if jsonl else None  # noqa: SIM115 (open for the run)
        self.failed: list[str] = []

    def report(self, name: str, status: str, detail: str = "", **fields: Any) -> None:
        if status == "failed":
            self.failed.append(name)
        text = {"ok": "ok", "failed": "FAILED", "skipped": "skipped"}[status]
        print(f"[{time.monotonic() - START:6.1f}s] {name}: {text}{': ' + detail if detail else ''}", flush=True)
        if self.fh:
            self.fh.write(json.dumps({"check": name, "status": status, "detail": detail,
                                      "t": round(time.monotonic() - START, 2), **fields}) + "\n")
            self.fh.flush()

    def forked(self, name: str, work: Callable[[], dict], limit: float, scratch: Path) -> dict | None:
        """``work()`` in a fork of its own, the libraries' prints and progress bars silenced (its result:
        ``status``, ``detail`` and more), reported."""
        def silenced() -> dict:
            with quiet():
                return work()

        result, pid, seconds = in_child(silenced, scratch / f"{name}.json", limit, lambda pid: None)
        if "error" in result:
            self.report(name, "failed", result["error"], seconds=round(seconds, 1), pid=pid)
            return None
        self.report(name, result.pop("status"), result.pop("detail", ""), seconds=round(seconds, 1), pid=pid,
                    **result)
        return result


def expected_defaults(device: str) -> dict[str, Any]:
    """What ``auto`` should give on ``device``: the first of device_defaults.py's choices that runs here."""
    from ftcore_plugins.common.device_defaults import defaults, loss_kernel_for
    from ftcore_plugins.trainers._packing import path_problem

    table = defaults(device)
    return {"packed_attention": next((p for p in table.packed_attention if path_problem(p, device) is None),
                                     "sdpa_per_sample"),
            "loss_kernel": loss_kernel_for(device), "optimizer": table.optimizer,
            "loss_chunk_elements": table.loss_chunk_elements}


def check_defaults(model_dir: Path, device: str, work: Path) -> dict:
    """The stage's choices with the model loaded as the ``hf`` loader leaves it (on the CPU, unquantized)."""
    from transformers import AutoModelForCausalLM

    from ftcore.testing import stage_context
    from ftcore_plugins.templates.chatml import ChatMLTemplate
    from ftcore_plugins.trainers.sft import SFT

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = load_tokenizer(model_dir)
    tiny = type("Tiny", (), {"model": model, "tokenizer": tokenizer, "template": ChatMLTemplate()})()
    ctx = stage_context(tiny, work)
    chosen = SFT(SFT.Options(packing=True, max_length=256)).device_choices(ctx, device)
    expected = expected_defaults(device)
    wrong = {k: (chosen[k], v) for k, v in expected.items() if chosen[k] != v}
    where = next(model.parameters()).device.type
    detail = ", ".join(f"{k} {chosen[k]}" for k in expected) + f" (model on the {where} when chosen)"
    if wrong:
        return {"status": "failed", "detail": "; ".join(f"{k} {got}, expected {want}" for k, (got, want) in
                                                        wrong.items())}
    return {"status": "ok", "detail": detail, "chosen": {k: chosen[k] for k in expected}}


def check_triton() -> dict:
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(x, out, n, block: tl.constexpr):
        offsets = tl.program_id(0) * block + tl.arange(0, block)
        mask = offsets < n
        tl.store(out + offsets, tl.load(x + offsets, mask=mask) + 1, mask=mask)

    x = torch.arange(1000, device="cuda", dtype=torch.float32)
    out = torch.empty_like(x)
    add_one[(triton.cdiv(1000, 256),)](x, out, 1000, block=256)
    ok = torch.equal(out, x + 1)
    return {"status": "ok" if ok else "failed", "detail": f"triton {triton.__version__}: kernel built and run"
            if ok else "the kernel ran and gave a wrong result"}


def train_arm(name: str, model_dir: Path, rows: Path, work: Path, gpu: bool, max_length: int,
              batch_size: int) -> dict:
    method, packing, extra, _, checks_defaults = ARMS[name]
    adapter = '"full"' if method == "full" else '{ use = "lora", r = 8, lora_alpha = 16 }'
    plan = work / f"{name}.toml"
    plan.write_text(HF_SFT_PLAN.format(
        name=name, model=model_dir, rows=rows, dtype="bfloat16" if gpu else "float32", model_extra="",
        quantizer=f"[quantizer]\n{QUANTIZERS[method]}" if method in QUANTIZERS else "", adapter=adapter, max_steps=STEPS,
        batch_size=batch_size, max_length=max_length, learning_rate=1e-3, packing="true" if packing else "false",
        stage_extra=extra))
    run_dir = Path(run_ftcore(plan)["run_dir"])
    losses, chosen = [], {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("stage") != "sft":
            continue
        if row.get("step") == 0:
            chosen.update({k: v for k, v in row.items() if k in ("loss_kernel", "packed_attention", "optimizer")})
        elif "loss" in row and "train_loss" not in row:
            losses.append(row["loss"])
    problems = []
    if len(losses) != STEPS:
        problems.append(f"{len(losses)} losses logged for {STEPS} steps")
    if not all(math.isfinite(x) for x in losses):
        problems.append(f"a loss is not finite: {losses}")
    if checks_defaults:
        expected = expected_defaults("cuda" if gpu else "cpu")
        for key in ("loss_kernel", "optimizer", *(["packed_attention"] if packing else [])):
            if chosen.get(key) != expected[key]:
                problems.append(f"{key} {chosen.get(key)}, the device's default is {expected[key]}")
    detail = (f"losses {' '.join(f'{x:.3f}' for x in losses)}; " +
              ", ".join(f"{k} {v}" for k, v in sorted(chosen.items())))
    return {"status": "failed" if problems else "ok", "detail": "; ".join(problems) + (" | " if problems else "")
            + detail, "losses": losses, "chosen": chosen}


def check_packed_equals_unpacked(model_dir: Path, gpu: bool, max_length: int) -> dict:
    """The same samples as padded rows and as packed bins on each packed path: the summed loss and the LM
    head's gradient agree within the precision's tolerance."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM
    from trl.data_utils import pack_dataset
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from ftcore_plugins.trainers._packing import BinnedBatches, attention_for, fixed_width, path_problem

    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    # bf16: the padded and the packed batch run different kernels, each rounding to 8 bits of mantissa
    tolerance = {"loss": 2e-2, "head gradient": 5e-2} if gpu else {"loss": 1e-4, "head gradient": 1e-4}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).train()
    vocab = model.config.vocab_size
    rng = random.Random(3)
    samples = [[rng.randrange(4, vocab) for _ in range(rng.randint(8, max_length // 3))] for _ in range(12)]

    def loss_and_grad(batch: dict) -> tuple[float, Any]:
        model.zero_grad()
        inputs = {k: v.to(device) for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids")}
        logits = model(**inputs, use_cache=False).logits[:, :-1].float()
        labels = batch["labels"][:, 1:].to(device)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1), ignore_index=-100,
                                                 reduction="sum")
        loss.backward()
        return loss.item(), model.get_output_embeddings().weight.grad.float().clone()

    width = max(len(s) for s in samples)
    padded = {"input_ids": torch.zeros((len(samples), width), dtype=torch.long),
              "attention_mask": torch.zeros((len(samples), width), dtype=torch.long),
              "labels": torch.full((len(samples), width), -100)}
    for i, s in enumerate(samples):
        padded["input_ids"][i, :len(s)] = torch.tensor(s)
        padded["attention_mask"][i, :len(s)] = 1
        padded["labels"][i, 1:len(s)] = torch.tensor(s[1:])  # each sample's first token is not predicted
    reference, reference_grad = loss_and_grad(padded)
    bins = list(pack_dataset(datasets.Dataset.from_list([{"input_ids": s, "labels": s} for s in samples]),
                             max_length, strategy="bfd"))
    paths = ["flex", "sdpa_block"] if gpu else ["sdpa_per_sample", "sdpa_block"]
    results, problems = {}, []
    for path in paths:
        if (why := path_problem(path, device)) is not None:
            results[path] = f"skipped: {why}"
            continue
        if path == "sdpa_per_sample":
            batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(bins)
        else:
            batch = BinnedBatches(0, fixed_width(path, max_length), rows=len(bins))(bins)
        with attention_for(model, path):
            loss, grad = loss_and_grad(batch)
        grad_diff = ((grad - reference_grad).norm() / reference_grad.norm()).item()
        loss_diff = abs(loss - reference) / abs(reference)
        results[path] = f"loss {loss_diff:.1e}, head gradient {grad_diff:.1e} relative"
        if loss_diff > tolerance["loss"] or grad_diff > tolerance["head gradient"]:
            problems.append(f"{path}: {results[path]} (tolerances {tolerance})")
    detail = f"{len(samples)} samples in {len(bins)} bins, {'bf16' if gpu else 'fp32'}: " + \
        "; ".join(f"{p} {r}" for p, r in results.items())
    return {"status": "failed" if problems else "ok", "detail": detail, "paths": results}


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def build(folder: Path, rows_path: Path, gpu: bool, max_length: int, batch_size: int) -> dict:
    """The tiny Llama around the real Llama 3 tokenizer (with ChatML's tokens, as the template adds them),
    saved, and chat rows of varied lengths."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    source = SHARED / "tokenizers" / "llama3"
    if not source.exists():
        return {"status": "failed", "detail": f"no Llama 3 tokenizer at {source} (../shared/fixtures, or "
                                              ".device/shared on the GPU machine after setup.sh)"}
    tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    config = LlamaConfig(**CONFIG, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if gpu else torch.float32)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "model", "token", "answer", "question", "the", "a", "of"]
    with rows_path.open("w", encoding="utf-8") as fh:
        for _ in range(batch_size * (STEPS + 2) * 3):
            n = rng.randint(4, max_length // 4)
            fh.write(json.dumps({"messages": [
                {"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(3, 12)))},
                {"role": "assistant", "content": " ".join(rng.choices(words, k=n))}]}) + "\n")
    return {"status": "ok", "detail": f"Llama 3 tokenizer ({len(tokenizer)} tokens), "
                                      f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters"}


def run_gpu_tests() -> dict:
    """``pytest -m gpu`` on the test files that have such tests (collecting every file would import packages
    the GPU machine lacks), in a process of its own."""
    if importlib.util.find_spec("pytest") is None:
        return {"status": "skipped", "detail": "pytest is not installed on this machine"}
    files = sorted(str(f) for f in (ROOT / "tests").glob("test_*.py") if "pytest.mark.gpu" in f.read_text())
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *files],
                          capture_output=True, text=True, cwd=ROOT, timeout=170)
    tail = (proc.stdout.strip().splitlines() or [""])[-1]
    if proc.returncode not in (0, 5):  # 5: none collected
        print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n", flush=True)
    return {"status": "ok" if proc.returncode == 0 else "failed", "detail": tail}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="on a CPU: the checks a CPU runs, shorter rows")
    parser.add_argument("--jsonl", type=Path, help="a JSON line per check, written as it finishes")
    parser.add_argument("--arms", help=f"comma-separated training arms (default all): {', '.join(ARMS)}")
    args = parser.parse_args()
    # Whether there is a GPU, through NVML: this process never initialises CUDA (its forks could not use it).
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    gpu = torch.cuda.is_available()
    if not gpu and not args.tiny:
        sys.exit("gpu_smoke: no CUDA device here; --tiny runs the checks a CPU can run")
    max_length, batch_size = (256, 4) if gpu else (128, 2)
    arms = args.arms.split(",") if args.arms else list(ARMS)
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        parser.error(f"unknown arm(s) {', '.join(unknown)}; there are {', '.join(ARMS)}")
    scratch = Path(tempfile.mkdtemp(prefix="ftcore-smoke-"))
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    os.environ.setdefault("FTCORE_CACHE_DIR", str(scratch / "cache"))
    checks = Checks(args.jsonl)
    device, preloaded = "no GPU (the CUDA checks are skipped)", PRELOAD
    if gpu:  # its name, and what this process may import without initialising CUDA, from a child of its own
        found, _, _ = in_child(lambda: probe(PRELOAD), scratch / "probe.json", 300, lambda pid: None)
        device = found.get("device") or f"a CUDA device (its name unread: {found.get('error')})"
        preloaded = PRELOAD[:found.get("preload", 0)]
    print(f"gpu_smoke: {device}; machine {machine()}; this process {os.getpid()}, each check in a fork of its "
          f"own; scratch {scratch}", flush=True)
    preload(preloaded)  # the libraries every check uses, imported once before the first fork
    no_gpu = "no GPU"
    from ftcore_plugins.common.device_defaults import triton_problem

    problem = triton_problem()
    checks.report("c-compiler", "failed" if problem else "ok", problem or
                  (os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")))
    if not gpu:
        checks.report("triton-launcher", "skipped", no_gpu)
    elif importlib.util.find_spec("triton") is None:
        checks.report("triton-launcher", "failed", "triton is not installed")
    else:
        checks.forked("triton-launcher", check_triton, 120, scratch)
    model_dir, rows = scratch / "model", scratch / "rows.jsonl"
    if checks.forked("model", lambda: build(model_dir, rows, gpu, max_length, batch_size), 120, scratch) is None \
            or not model_dir.exists():
        print("gpu_smoke: no model, so no training checks", flush=True)
    else:
        checks.forked("defaults", lambda: check_defaults(model_dir, "cuda" if gpu else "cpu", scratch / "ctx"), 60,
                      scratch)
        for name in arms:
            if ARMS[name][3] and not gpu:
                checks.report(name, "skipped", no_gpu)
                continue
            checks.forked(name, lambda name=name: train_arm(name, model_dir, rows, scratch, gpu, max_length,
                                                            batch_size), 150, scratch)
        checks.forked("packed-equals-unpacked", lambda: check_packed_equals_unpacked(model_dir, gpu, max_length),
                      120, scratch)
    if gpu:
        result = run_gpu_tests()
        checks.report("pytest -m gpu", result["status"], result["detail"])
    else:
        checks.report("pytest -m gpu", "skipped", no_gpu)
    print(f"gpu_smoke: {len(checks.failed)} failed{': ' + ', '.join(checks.failed) if checks.failed else ''}; "
          f"{time.monotonic() - START:.0f} s", flush=True)
    sys.exit(1 if checks.failed else 0)


if __name__ == "__main__":
    main()
