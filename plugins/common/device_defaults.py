"""Speed and memory defaults per device type.

What wins on a CPU can lose badly on a GPU: a Python loop over a packed batch's samples is cheap on a
CPU and thousands of small kernels and host syncs on a GPU; fp32 copies of the embeddings cost a CPU
nothing (it computes in fp32 anyway) and a GPU gigabytes. So each option below whose value is
``"auto"`` in a plan takes the default of the device the stage trains on (:func:`training_device`: where
the Trainer will put the model, not where the loader left it), and each default says where it was
measured (``benchmarks/RESULTS.md``) or that it was not.

Only the built-in plugins read this table; ``ftcore estimate --device`` reads the same defaults for
the device it estimates for, so the estimate describes the run that would happen there.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceDefaults:
    """The defaults of one device type; tuples are orders of preference (the first that runs here)."""

    packed_attention: tuple[str, ...]  # the attention path of packed batches (sft's packed_attention)
    loss_kernels: tuple[str, ...]  # sft/pretrain's loss_kernel = "auto"
    loss_chunk_elements: int  # logits per chunk of the chunked loss
    fp32_non_quantized: bool  # QLoRA: keep norms, embeddings and the LM head in fp32
    optimizer: str  # optimizer = "auto"
    compile: bool  # torch.compile of the decoder blocks
    sources: dict[str, str]  # option -> where its default was measured, or "unmeasured: why"


CPU = DeviceDefaults(
    packed_attention=("sdpa_per_sample",),
    loss_kernels=("chunked",),
    loss_chunk_elements=1 << 24,
    fp32_non_quantized=True,
    optimizer="adamw_torch",
    compile=False,
    sources={
        "packed_attention": "RESULTS.md, Packing: per-sample SDPA 1.87-1.94x unpacked; the block mask over "
                            "the row 0.83-0.88x",
        "loss_kernels": "RESULTS.md, Loss kernels: chunked 0.40x/0.77x the full loss's step time, 0.07x/0.44x "
                        "its memory",
        "loss_chunk_elements": "RESULTS.md, Loss kernels (16M logits a chunk)",
        "fp32_non_quantized": "a CPU computes in fp32 (precision auto): the copies are the weights themselves",
        "optimizer": "unmeasured on CPU against the fused AdamW; the torch default implementation",
        "compile": "RESULTS.md, Compile: 0.77-1.10x a step for 35-40 s of compile a stage",
    },
)

CUDA = DeviceDefaults(
    packed_attention=("varlen", "flex", "sdpa_block"),
    loss_kernels=("liger", "chunked"),
    loss_chunk_elements=1 << 26,
    fp32_non_quantized=False,
    optimizer="adamw_torch_fused",
    compile=False,
    sources={
        "packed_attention": "unmeasured: library kernels with no loop over samples; one host sync a forward "
                            "pass, in transformers' mask code (benchmarks/gpu_throughput.py --quick measures "
                            "each path)",
        "loss_kernels": "unmeasured: Liger's fused linear cross-entropy where installed, else chunked "
                        "(gpu_throughput.py --quick arms loss-full, loss-trl, liger)",
        "loss_chunk_elements": "unmeasured: 64M logits, 512 rows of a 128k vocabulary, about the rows a chunk "
                               "Liger takes at 8B and 16k positions a step; fewer rows leave the head's "
                               "matrix products bound by reading its weight",
        "fp32_non_quantized": "unmeasured here; TRL keeps them in bf16, and fp32 copies of a 128k-vocabulary "
                              "8B model's embeddings and head are 4.2 GB",
        "optimizer": "unmeasured: one fused kernel for every parameter (gpu_throughput.py arm adamw-fused)",
        "compile": "unmeasured on CUDA (gpu_throughput.py arm compile)",
    },
)

DEVICES = {"cpu": CPU, "cuda": CUDA}


def device_type() -> str:
    """``"cuda"`` where a GPU is visible (its device files; torch is not imported), else ``"cpu"``."""
    from ftcore_plugins.common.memory import gpu_visible

    return "cuda" if gpu_visible() else "cpu"


def defaults(device: str | None = None) -> DeviceDefaults:
    """The defaults of ``device`` (``"cpu"``, ``"cuda"``; a ``"cuda:1"`` counts as cuda), or of this machine."""
    device = device_type() if device is None else device.split(":")[0]
    return DEVICES.get(device, CPU)


def training_device() -> str:
    """``"cuda"`` or ``"cpu"``: the device type a stage trains on in this process, as transformers'
    ``TrainingArguments.device`` gives it (a GPU whenever torch sees one; ftcore sets ``use_cpu`` only
    where it sees none). Every per-device default is decided from this, before the Trainer exists: an
    unquantized model is loaded on the CPU and moved to the GPU only by the Trainer's ``__init__``, so
    where the loaded model sits says nothing about where it trains."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def optimizer_for(name: str, device: str | None = None) -> str:
    """``optimizer = "auto"``: the optimizer of ``device`` (this machine's when None), AdamW fused into one
    kernel on a GPU; any other name as it is."""
    return defaults(device).optimizer if name == "auto" else name


def loss_kernel_for(device: str) -> str:
    """``loss_kernel = "auto"`` on ``device``: the first of its defaults that runs here (Liger needs a GPU,
    liger-kernel, and a C compiler for Triton)."""
    import importlib.util

    runs = {"liger": device == "cuda" and importlib.util.find_spec("liger_kernel") is not None
            and triton_problem() is None}
    return next((k for k in defaults(device).loss_kernels if runs.get(k, True)), "chunked")


def triton_problem() -> str | None:
    """Why Triton kernels (flex attention's, Liger's) cannot be built here, or None. Triton compiles a
    small C launcher for each kernel with the compiler that ``$CC`` names, else gcc, else clang (as its
    ``runtime/build.py`` looks them up); without one, the first training step fails."""
    import os
    import shutil

    cc = os.environ.get("CC")
    if cc:
        return None if shutil.which(cc) else f"Triton builds its kernels' launchers with $CC ({cc}), which is not found"
    if shutil.which("gcc") or shutil.which("clang"):
        return None
    return "Triton builds its kernels' launchers with a C compiler (gcc or clang, or $CC), and none is on PATH"
