"""What the built-in components answer to ``ftcore estimate`` (see ``ftcore/estimate.py``).

Each function here backs one optional method of a built-in component, which delegates to it
in a line or two, so the estimate's knowledge of the built-ins lives in one module:

- model loaders ``hf`` and ``scratch``: ``meta_model()``, the model on the ``meta`` device
  (no weights are read, no memory is used) and its config;
- the bitsandbytes quantizers: ``prepare_meta(model, *, device)`` (what ``prepare()`` does to
  dtypes, trainability and checkpointing on that device) and ``weight_bytes(model)`` (the weights as stored);
  the other quantizers' ``weight_bytes`` is :func:`packed_weight_bytes` over their own ``packed_bytes``;
- trainers ``sft`` and ``pretrain`` (TRL's SFTTrainer): ``memory_settings()``,
  ``activation_bytes(...)``, ``optimizer_bytes(...)`` and ``runtime_bytes(...)``.

The activation and optimizer numbers follow what these libraries allocate; the figures
below were checked against measured peaks (``tests/test_estimate.py``,
``benchmarks/memory_estimate.py``) on CPU, fp32. The 16-bit and CUDA paths are the same
accounting with the dtypes and kernels those paths use, not measured here.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

MiB = 2**20

# -- model loaders -------------------------------------------------------------------------


def meta_model_from_config(config: Any, dtype: Any, **kwargs: Any) -> Any:
    """A causal LM (or a vision-language model) built from ``config`` on the meta device: exact shapes,
    no memory."""
    import torch
    from transformers import AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    from ftcore_plugins.common.seq2seq import auto_class

    vlm = getattr(config, "model_type", None) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES and \
        getattr(config, "vision_config", None) is not None
    with torch.device("meta"):  # an encoder-decoder (T5, BART) as a seq2seq LM
        return (AutoModelForImageTextToText if vlm else auto_class(config)).from_config(config, dtype=dtype, **kwargs)


def _checkpoint_dtype(folder: Path) -> Any:
    """The dtype of the first tensor in the folder's safetensors files (header only), or None."""
    try:
        from safetensors import safe_open
    except ImportError:  # pragma: no cover
        return None
    import torch

    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():
                    return getattr(torch, {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(
                        f.get_slice(key).get_dtype(), "float32"))
        except Exception:
            return None
    return None


def hf_meta_model(loader: Any) -> tuple[Any, Any]:
    """``hf``: the config from the model folder (or the local hub cache: never the network)."""
    import torch
    from transformers import AutoConfig

    from ftcore.errors import FtcoreError

    o = loader.options
    try:
        config = AutoConfig.from_pretrained(o.path, revision=o.revision, trust_remote_code=o.trust_remote_code,
                                            token=o.token.get_secret_value() if o.token else None,
                                            local_files_only=True)
    except (OSError, ValueError) as exc:
        local = Path(o.path).exists()
        hint = "" if local else " (not a local folder, and not in the local hub cache; estimate never downloads)"
        raise FtcoreError(f"model.path: cannot read the config of {o.path!r}{hint}: "
                          f"{str(exc).strip().splitlines()[0]}") from None
    configure = getattr(loader, "configure", None)
    if configure is not None:  # what the plan changes in the config (hf's rope_scaling), as a run builds it
        config = configure(config)
    if o.dtype != "auto":
        dtype = getattr(torch, o.dtype)
    else:  # as from_pretrained: the config's dtype, else the checkpoint's, else torch's default
        dtype = getattr(config, "dtype", None) or (_checkpoint_dtype(Path(o.path)) if Path(o.path).is_dir()
                                                   else None) or torch.get_default_dtype()
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
    kwargs = {"trust_remote_code": o.trust_remote_code}
    if o.attn_implementation:
        kwargs["attn_implementation"] = o.attn_implementation
    return meta_model_from_config(config, dtype, **kwargs), config


def hf_checkpoint_residue_bytes(loader: Any, quantized: bool) -> int:
    """``hf``: checkpoint pages that stay resident after loading, beyond the weights.

    Quantizing while loading, transformers reads every weight from the memory-mapped safetensors
    files; the mapping, and every page read through it, stays alive while an unquantized weight
    still views it. That is the case when the checkpoint is float32: the bitsandbytes preparation
    keeps such weights (norms, embeddings) in float32, as views (measured: +212 MiB of file pages
    for a 209 MiB float32 checkpoint). A half-precision checkpoint's are converted, the mapping
    closes: nothing stays (measured on Qwen2.5-0.5B's bf16 checkpoint: the process's file pages
    after loading are its libraries'). Unquantized, the weights are the mapped pages themselves."""
    import torch

    folder = Path(loader.options.path)
    if not quantized or not folder.is_dir() or _checkpoint_dtype(folder) != torch.float32:
        return 0
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def scratch_meta_model(loader: Any) -> tuple[Any, Any]:
    """``scratch``: the config it would build. A tokenizer trained at run time has at most
    ``vocab_size`` tokens (fewer on very little text), so that is the vocabulary counted."""
    import torch

    o = loader.options
    if o.tokenizer is not None:
        from transformers import AutoTokenizer

        vocab = len(AutoTokenizer.from_pretrained(str(o.tokenizer)))
    else:
        vocab = o.vocab_size
    config = loader.model_config(vocab)
    return meta_model_from_config(config, torch.float32), config


# -- mixture of experts ----------------------------------------------------------------------

# The config fields that say how many routed experts a token goes through (transformers' names across
# its MoE families; DBRX keeps it in a sub-config, ffn_config.moe_top_k).
_PER_TOKEN = ("num_experts_per_tok", "moe_topk", "moe_top_k", "moe_k", "experts_per_token")


def experts_per_token(config: Any) -> int | None:
    """How many routed experts each token goes through, from the (language model's) config or a sub-config."""
    c = _text_config(config)
    subs = [v for v in vars(c).values() if hasattr(v, "to_dict") and hasattr(v, "model_type")] if c is not None else []
    for where in (c, *subs):
        for name in _PER_TOKEN:
            value = getattr(where, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def routed_experts(model: Any) -> list[tuple[int, int]]:
    """Each block of routed experts in the model as (how many experts, their parameters), read from the
    model itself: a module holding the experts as 3-D parameters (``mlp.experts``: every parameter of its own
    with one row per expert, biases too), or a list of experts (``experts.0.gate_proj``, ...: everything in
    it). Shared experts (``shared_expert``, ``shared_experts``) are not routed: every token uses them."""
    import torch

    from ftcore_plugins.common.experts import expert_parameters

    holders: dict[str, int] = {}
    for path, param in expert_parameters(model).items():
        holders.setdefault(path.rpartition(".")[0], param.shape[0])
    blocks = [(count, sum(p.numel() for p in model.get_submodule(path).parameters(recurse=False)
                          if p.dim() and p.shape[0] == count)) for path, count in holders.items()]
    for path, module in model.named_modules():
        last = path.rsplit(".", 1)[-1].lower()
        if isinstance(module, torch.nn.ModuleList) and "expert" in last and "shared" not in last and len(module) > 1:
            blocks.append((len(module), sum(p.numel() for p in module.parameters())))
    return blocks


def moe_parameters(model: Any, config: Any) -> dict[str, int] | None:
    """A mixture-of-experts model's parameters: ``total``, ``active`` (what one token goes through: everything
    but the routed experts, and ``per_token`` of each block's ``experts``), ``routed`` (the routed experts' own).
    None for a model without routed experts, or whose config does not say how many a token uses."""
    blocks = routed_experts(model)
    per_token = experts_per_token(config) if blocks else None
    if not blocks or per_token is None:
        return None
    total = sum(p.numel() for p in model.parameters())
    routed = sum(n for _, n in blocks)
    active = total - routed + sum(n * min(per_token, count) // count for count, n in blocks)
    counts = sorted({count for count, _ in blocks})
    return {"total": total, "active": active, "routed": routed, "per_token": per_token, "experts": counts[-1]}


def moe_line(moe: dict[str, int]) -> str:
    """``30,532,122,624 parameters, 3,353,032,704 active per token (8 of 128 routed experts)``."""
    return (f"{moe['total']:,} parameters, {moe['active']:,} active per token ({moe['per_token']} of "
            f"{moe['experts']} routed experts)")


# -- bitsandbytes quantizers ---------------------------------------------------------------


def _not_converted(model: Any, skip: list[str]) -> set[str]:
    """Module paths transformers leaves unquantized: the output head, tied weights, ``skip``, and a
    vision-language model's vision tower and projector (ftcore's quantizers skip them)."""
    try:
        from transformers.quantizers.base import get_keys_to_not_convert

        keep = set(get_keys_to_not_convert(model))
    except Exception:  # pragma: no cover - older/newer transformers
        head = model.get_output_embeddings()
        keep = {n for n, m in model.named_modules() if m is head}
    keep |= set(getattr(model, "_keep_in_fp32_modules", None) or [])
    keep |= set(skip)
    from ftcore_plugins.common.vision import vision_parts

    tower, projector = vision_parts(model)  # QLoRA leaves a VLM's vision tower and projector unquantized
    return keep | set(tower) | set(projector)


def convertible_linears(model: Any, skip: list[str]) -> dict[str, Any]:
    """The linear layers transformers' quantizers convert, by path: every ``nn.Linear`` but the ones
    :func:`_not_converted` keeps (the output head, tied weights, ``skip``, a VLM's vision parts)."""
    import torch

    keep = _not_converted(model, skip)

    def kept(path: str) -> bool:
        parts = path.split(".")
        return any(k == path or path.endswith("." + k) or path.startswith(k + ".") or k in parts for k in keep)

    return {path: m for path, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and path and not kept(path)}


# Of the dequantized copies a step makes, the share its peak keeps, where a step's activations outgrow the largest
# copy and where they do not: fitted on Qwen2.5-0.5B's config at 2 x 512 and 2 x 256 tokens over three runs of five
# quantizers (benchmarks/RESULTS.md, "Quantizer memory"), where the rest of the estimate fell short by 0.43 to 1.10
# and by -0.01 to 0.48 of one copy of every quantized weight: every peak is then within 13%.
DEQUANT_RESIDUE = 0.85
DEQUANT_RESIDUE_REUSED = 0.25


def dequantized_step_bytes(model: Any, skip: list[str], *, device: str = "cpu", tokens: int = 0,
                           size: int | None = None) -> int:
    """Heap a training step keeps on CPU for weights that are dequantized for every matmul, beyond the
    activations.

    Without a CPU kernel for the packed format (bitsandbytes 4-bit, HQQ, torchao's and Quanto's
    weight-only layouts), each quantized weight is dequantized to ``size``-byte values (default: its
    dtype) for every matmul: forward, the checkpointed recompute, backward. The copies are freed at once,
    but below glibc's largest mmap threshold (32 MiB) they live on the heap, interleaved with the
    activations, and fragment it. Where the step's activations outgrow them (``tokens`` x the widest
    layer's outputs above its largest copy) the peak grows by :data:`DEQUANT_RESIDUE` of one copy of every
    quantized weight; below that the activations reuse most of the copies' space, and
    :data:`DEQUANT_RESIDUE_REUSED` stays. On CUDA the caching allocator reuses them: 0."""
    if device == "cuda" or tokens <= 0:
        return 0
    linears = [m.weight for m in convertible_linears(model, skip).values()]
    if not linears:
        return 0
    copies = [w.numel() * (size or w.element_size()) for w in linears]
    widest = max(w.shape[0] * (size or w.element_size()) for w in linears)
    share = DEQUANT_RESIDUE if tokens * widest > max(copies) else DEQUANT_RESIDUE_REUSED
    return int(share * sum(copies))


def bnb_step_bytes(quantizer: Any, model: Any, *, device: str = "cpu", tokens: int = 0) -> int:
    """:func:`dequantized_step_bytes` for bitsandbytes: 4-bit weights, in the compute dtype. 8-bit
    (int8 matmuls on its own kernel): not measured, counted as nothing."""
    o = quantizer.options
    if getattr(quantizer, "bits", 4) != 4:
        return 0
    size = 2 if getattr(o, "bnb_4bit_compute_dtype", "auto") in ("bfloat16", "float16") else 4
    return dequantized_step_bytes(model, list(getattr(o, "llm_int8_skip_modules", None) or []),
                                  device=device, tokens=tokens, size=size)


def packed_weight_bytes(model: Any, packed: Any, skip: list[str]) -> int:
    """Bytes of a model whose linear layers a quantizer stores packed: ``packed(shape, scale_size)`` for each
    layer it converts (the ones transformers' quantizers convert, less ``skip``), with its scales in the
    layer's dtype of ``scale_size`` bytes; every other weight and buffer at its dtype."""
    quantized = convertible_linears(model, skip)
    ids = {id(m.weight) for m in quantized.values()}
    total = sum(packed(tuple(m.weight.shape), m.weight.element_size()) for m in quantized.values())
    total += sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in ids)
    return total + sum(b.numel() * b.element_size() for b in model.buffers())


BNB_BASE = "_ftcore_bnb_bits"  # on a meta model whose linear layers bitsandbytes would hold: their bits


def bnb_prepare_meta(quantizer: Any, model: Any, *, device: str = "cpu") -> Any:
    """What ``BnbQuantizer.prepare`` does on ``device``, on the meta model: every weight frozen,
    non-reentrant checkpointing on, and the 16-bit weights that stay unquantized upcast to fp32
    where the quantizer keeps them in fp32 there (``fp32_non_quantized``, else the device's
    default: peft's ``prepare_model_for_kbit_training`` on CPU), else left in the model's dtype.
    The quantized ones are counted by :func:`bnb_weight_bytes`."""
    import torch

    keep = getattr(quantizer, "keeps_fp32", None)
    upcast = keep(device) if callable(keep) else True
    for p in model.parameters():
        p.requires_grad_(False)
        if upcast and p.dtype in (torch.float16, torch.bfloat16):
            p.data = p.data.to(torch.float32)
    if getattr(quantizer.options, "gradient_checkpointing", True):
        from ftcore_plugins.common.model import checkpointing_on

        checkpointing_on(model)
    model.config.use_cache = False
    setattr(model, BNB_BASE, getattr(quantizer, "bits", 4))
    return model


def bnb_weight_bytes(quantizer: Any, model: Any) -> int:
    """Bytes of the weights as bitsandbytes stores them.

    4-bit: two weights per byte, plus one absmax per 64-weight block, itself 8-bit with an fp32
    constant per 256 blocks under double quantization (else fp32). 8-bit: one byte per weight
    plus an fp32 scale per output row. Everything else at its dtype after :func:`bnb_prepare_meta`
    (fp32 where the quantizer keeps the non-quantized weights in fp32, else the model's)."""
    o = quantizer.options
    bits = getattr(quantizer, "bits", 4)
    quantized = convertible_linears(model, list(getattr(o, "llm_int8_skip_modules", None) or []))
    skipped = set()
    total = 0
    for m in quantized.values():
        n = m.weight.numel()
        skipped.add(id(m.weight))
        if bits == 4:
            blocks = math.ceil(n / 64)
            if getattr(o, "bnb_4bit_use_double_quant", False):
                constants = blocks + math.ceil(blocks / 256) * 4 + 256 * 4  # 8-bit absmax, fp32 per 256, code book
            else:
                constants = blocks * 4
            total += math.ceil(n / 2) + constants
        else:
            total += n + m.weight.shape[0] * 4
    for p in model.parameters():
        if id(p) not in skipped:
            total += p.numel() * p.element_size()
    return total + sum(b.numel() * b.element_size() for b in model.buffers())


# -- trainers (TRL SFTTrainer) ----------------------------------------------------------------

# Optimizer state, in units of the trainable parameters' own bytes, and per parameter bytes
# for the 8-bit ones; transformers' `optim` names.
_STATE_COPIES = {
    "adamw_torch": 2, "adamw_torch_fused": 2, "adamw_torch_xla": 2, "adamw_torch_npu_fused": 2,
    "adamw_apex_fused": 2, "adamw_anyprecision": 2, "adamw_bnb_32bit": 2, "paged_adamw_32bit": 2,
    "adamw_32bit": 2, "ademamix": 3, "paged_ademamix_32bit": 3, "lion_32bit": 1, "paged_lion_32bit": 1,
    "rmsprop": 1, "rmsprop_bnb_32bit": 1, "adagrad": 1, "sgd": 0, "schedule_free_sgd": 1,
    "schedule_free_adamw": 2, "schedule_free_radam": 2,
}
_EIGHT_BIT = {  # one byte per state value (+ a block constant per 2048 values)
    "adamw_bnb_8bit": 2, "adamw_8bit": 2, "paged_adamw_8bit": 2, "adamw_torch_4bit": 1,
    "adamw_torch_8bit": 2, "lion_8bit": 1, "paged_lion_8bit": 1, "rmsprop_bnb_8bit": 1,
    "ademamix_8bit": 3, "paged_ademamix_8bit": 3,
}

# TRL's fused LM head (trl.trainer.utils.add_fused_lm_head) never builds the whole logits: it
# projects tiles of at most 4096 tokens x 32768 vocabulary entries. Without Triton (CPU) its
# torch fallback keeps about 8.5 fp32 tiles alive in backward (the tile, its scaled copy,
# log-probabilities, probabilities, the gradient and the temporaries of its formula);
# with Triton (CUDA) one tile in the compute dtype and the kernel's own buffers.
_TILE_TOKENS, _TILE_VOCAB = 4096, 32768
# sft/pretrain's own loss (plugins/trainers/_loss.py), per loss_kernel. "chunked": a chunk of
# loss_chunk_elements fp32 logits (the device's, device_defaults.py, unless the trainer class sets its
# own), turned in place into probabilities and gradient, plus
# the max/index/sum rows and the autograd copies: about 2 chunks. "full": the logits in the
# model's dtype, their fp32 copy, the log-softmax and its gradient.
_CHUNK_BUFFERS = 2.0
_FULL_LOGIT_COPIES = 3
_CPU_TILES, _CUDA_TILES = 8.5, 2.0
_MMAP_THRESHOLD_MAX = 32 * MiB  # glibc, 64-bit: larger blocks are always mmapped, and unmapped when freed
# Without checkpointing, on CPU, a step's peak RSS is what autograd saves (counted here within 3% by saved-tensor
# hooks on the tiny Llama of benchmarks/sequence_parallel_memory.py) plus about one layer's saved tensors again:
# the backward of the last layer places its gradients (about as large as what the layer saved) above the saved
# tensors in glibc's heap, while they are all still alive (the RSS timeline of a step puts the peak there). The
# checkpointed count has the same term (a layer recomputed, with its gradients). Measured through `ftcore run` at
# 4,096 and 8,192 tokens, one process and two under sp_size 2: benchmarks/sequence_parallel_memory.py.
_CPU_BACKWARD_LAYERS = 1

# Process memory a TRL training run adds on CPU beyond what its imports take: the trainer,
# accelerate state, tokenized data, the data loader, thread pools, oneDNN caches and the
# allocator's retained blocks of the first step. Measured 70-120 MiB on the tiny models of
# benchmarks/memory_estimate.py, where nothing else is large.
_CPU_RUNTIME = 120 * MiB
# CUDA: the context (kernels, cuBLAS/cuDNN handles; not in torch's allocated figure, but in
# what the GPU has in use) and the caching allocator's reserve. Typical, not measured here.
_CUDA_RUNTIME = 768 * MiB


def trainer_memory_settings(trainer: Any, *, device: str = "cpu") -> dict[str, Any]:
    from ftcore_plugins.common.device_defaults import optimizer_for

    o = trainer.options
    optimizer = optimizer_for(o.optimizer, device)
    offloaded = device == "cuda" and getattr(o, "activation_offloading", False)  # turns checkpointing on
    out = {"batch_size": o.batch_size, "seq_len": o.max_length,
           "gradient_checkpointing": o.gradient_checkpointing or offloaded,
           "optimizer": optimizer, "precision": o.precision, "notes": []}
    if not getattr(o, "packing", True):  # sft without packing pads each batch to its longest row
        out["notes"].append(f"sequences counted at max_length ({o.max_length}), the longest a batch can be: "
                            "rows are padded to the longest in their batch, so shorter data takes less")
    if offloaded:
        out["notes"].append("activation offloading: each checkpointed layer's input waits in pinned host memory "
                            "(layers x tokens x hidden of it), one at a time on the GPU")
    if o.gradient_accumulation_steps > 1:
        out["notes"].append("gradient accumulation adds no memory: the batch is the per-step batch_size")
    return out


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _is_norm(module: Any) -> bool:
    name = type(module).__name__.lower()
    return "norm" in name and hasattr(module, "weight") and getattr(module, "weight", None) is not None


# What decoder layers call their MLP (as trainers/_tiled_mlp.py finds them; a mixture of experts is not tiled).
_MLP_NAMES = ("mlp", "feed_forward", "ffn")
# Which input of a Llama-style decoder layer each adapted linear layer reads.
_LORA_INPUTS = {"q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "o_proj": "attn_out",
                "gate_proj": "mlp_in", "up_proj": "mlp_in", "down_proj": "mlp_out"}


def _bnb_layer_bytes(h: int, q_dim: int, kv_dim: int, heads: int, inter: int, res: int, norm: int, layers: int,
                     adapted: list[tuple[str, str | None, int, int]], *, autocast: bool, cuda: bool) -> float:
    """Bytes a decoder layer saves for backward per token, on average over the layers, on a
    bitsandbytes base where 16-bit tensors are involved (a 16-bit model, or autocast).

    A bitsandbytes layer keeps no input (its weight is frozen) and returns its input's dtype, even
    under autocast: the projections of an fp32 residual stream are fp32. SDPA keeps query, key, value,
    output (in autocast's 16 bits where it runs) and its log-sum-exp; the MLP its gate, up and
    activation, in the dtype the projections return. Each LoRA A keeps its input and LoRA B the A
    output: peft casts the input to the fp32 adapter's dtype (a copy per adapted layer; autocast then
    makes it 16-bit again) except inside CUDA's autocast (its bnb layers test torch.is_autocast_enabled(),
    CUDA's), where autocast copies an fp32 input to 16 bits per layer and a 16-bit input is kept as it
    is, once for the layers that share it. Checked with saved-tensor hooks on a 4-bit Llama with LoRA
    on every linear layer, CPU and CUDA paths (tests/test_estimate.py)."""
    half = 2 if autocast else res  # what SDPA keeps: autocast's dtype, else the stream's
    layer = 2 * norm * h + (2 * q_dim + 2 * kv_dim) * half + heads * 4 + 3 * inter * res
    dtypes = {"attn_in": res, "attn_out": half, "mlp_in": res, "mlp_out": res}
    shared = {"attn_in": h, "attn_out": 0, "mlp_in": h, "mlp_out": inter}  # o_proj reads a view of SDPA's output
    kept: set[tuple[str, str]] = set()
    total = 0
    for parent, group, width, rank in adapted:
        total += rank * (2 if autocast else 4)  # the A output, kept by B: 16-bit under autocast, else fp32
        dtype = dtypes.get(group, res)
        if not (autocast and cuda) and dtype != 4:
            total += width * (2 if autocast else 4)  # peft's fp32 copy, 16-bit again under autocast
        elif autocast and dtype != 2:
            total += width * 2  # autocast's 16-bit copy, one per layer
        elif group is None:
            total += width * dtype  # an input this count does not place: counted as its own
        elif (parent, group) not in kept:  # q, k, v (gate, up) of one layer read one tensor
            kept.add((parent, group))
            total += shared[group] * dtype
    return layer + total / layers


def _dims(model_config: Any) -> tuple[int, int, int, int, int, int, int]:
    """(hidden, layers, heads, query width, key/value width, MLP width, vocabulary) of a decoder."""
    c = _text_config(model_config)
    h = getattr(c, "hidden_size", None) or getattr(c, "n_embd", None) or getattr(c, "d_model", None)
    layers = getattr(c, "num_hidden_layers", None) or getattr(c, "n_layer", None)
    if not h or not layers:
        raise ValueError("the model config has no hidden_size/num_hidden_layers")
    heads = getattr(c, "num_attention_heads", None) or getattr(c, "n_head", None) or 1
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or h // heads
    inter = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * h
    vocab = getattr(c, "vocab_size", 0) or 0
    return h, layers, heads, heads * head_dim, kv_heads * head_dim, inter, vocab


def _scan(model: Any, autocast: bool) -> dict[str, Any]:
    """What the activation count reads from the (meta) model: dtypes, what trains, the adapters."""
    import torch

    found: dict[str, Any] = {
        "res": 4,  # the residual stream's dtype: the input embeddings' (fp32 when no model is given)
        "norms_train": True,
        "lora_inputs": 0,  # sum of the adapted layers' input widths
        "lora_outputs": 0,  # sum of the LoRA ranks
        "lora_widths": [],  # the adapted layers' output widths
        "adapted": [],  # each adapted layer's parent module, input (_LORA_INPUTS), width and rank
        "mlp_lora": [],  # the adapted layers inside an MLP: (rank, input width, output width)
        "head_grad": 0,
        "cast_cache": 0,  # 16-bit copies of trainable fp32 matrices that autocast keeps through the forward
        "bnb_bits": getattr(model, BNB_BASE, 0) if model is not None else 0,
        "expert_blocks": [],  # LoRA on expert parameters: per experts module, (gradient, kept) bytes a tensor
        "expert_inputs": 0,  # bytes per token the adapted matmuls keep: inputs (rank-r products) per routed expert
    }
    if model is None:
        return found
    wrapped = _expert_lora(model, found)
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if getattr(emb, "weight", None) is not None:
        found["res"] = emb.weight.element_size()
    norms = [m for m in model.modules() if _is_norm(m)]
    found["norms_train"] = any(m.weight.requires_grad for m in norms) if norms else True
    lora_a_widths = {name.split(".lora_A")[0]: p.shape[1] for name, p in model.named_parameters()
                     if "lora_A" in name and p.dim() == 2}
    for name, p in model.named_parameters():
        if id(p) in wrapped:
            continue
        if p.requires_grad and "lora_A" in name and p.dim() == 2:
            found["lora_outputs"] += p.shape[0]
            found["lora_inputs"] += p.shape[1]
            parent, _, layer = name.split(".lora_A")[0].rpartition(".")
            found["adapted"].append((parent, _LORA_INPUTS.get(layer), p.shape[1], p.shape[0]))
        elif p.requires_grad and "lora_B" in name and p.dim() == 2:
            found["lora_widths"].append(p.shape[0])
            parent = name.split(".lora_B")[0].rpartition(".")[0]
            if parent.rpartition(".")[2] in _MLP_NAMES:
                found["mlp_lora"].append((p.shape[1], lora_a_widths.get(name.split(".lora_B")[0], 0), p.shape[0]))
        if autocast and p.requires_grad and p.dim() == 2 and p.dtype == torch.float32:
            found["cast_cache"] += p.numel() * 2
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    w = getattr(out, "weight", None)
    if w is not None and w.requires_grad and w.dtype != torch.float32:
        found["head_grad"] = w.numel() * 4  # the head's fp32 gradient before it is cast to the weight's dtype
    return found


def _expert_lora(model: Any, found: dict[str, Any]) -> set[int]:
    """Fill ``found``'s expert terms from peft's ``ParamWrapper`` layers (LoRA through ``target_parameters``) on 3-D
    expert parameters; the ids of their LoRA factors, which the per-layer LoRA count leaves out. Each tensor is
    entered as (the gradient backward makes of a whole-stack copy, or 0; what the tensor keeps through backward),
    and its matmuls' inputs per token, for the path it runs:

    - ftcore's grouped path (``plugins/common/expert_lora.py``, what the ``lora`` adapter runs on transformers'
      experts): the frozen weight's grouped matmul plus ``s (x A^T) B^T`` per expert. Backward keeps, per routed
      token, the input (for A's gradient) and the rank-r intermediate (for B's); per tensor, B in the experts'
      layout (a copy), and A where it is cast to the weight's dtype or padded to the 16-byte rank the grouped
      matmul needs. No copy of the expert stack, no gradient as large.
    - peft's own path, where the grouped one cannot run (``expert_lora.why_not``): the parameter reads as
      ``W + s B A`` for every expert at once (peft 0.21's ``_LoraFactorsProxy``: one ``baddbmm`` over the whole
      expert stack, its factors cast to the weight's dtype), which the experts' matmuls save for backward with
      their inputs (one row per routed token); backward then makes its gradient, as large again. Kept: the copy
      and the factors' cast copies where their dtype differs."""
    from ftcore_plugins.common.expert_lora import padded_rank, runs_grouped

    blocks: dict[int, dict[str, tuple[int, int]]] = {}
    order: dict[int, list[str]] = {}
    ids: set[int] = set()
    per_token = experts_per_token(getattr(model, "config", None)) or 1
    for module in model.modules():
        if type(module).__name__ != "ParamWrapper":
            continue
        factors = [*module.lora_A.parameters(), *module.lora_B.parameters()]
        ids |= {id(p) for p in factors}
        param = module.get_param()
        if param.dim() != 3:
            continue
        size = param.element_size()
        base = module.get_base_layer()
        order.setdefault(id(base), [n for n, _ in base.named_parameters(recurse=False)])
        if runs_grouped(module):
            a = module.lora_A[next(n for n in module.active_adapters if n in module.lora_A)].weight
            rank = padded_rank(a.shape[0] // module.num_experts, param.dtype)
            copied_a = a.dtype != param.dtype or rank * module.num_experts != a.shape[0]
            kept = module.num_experts * rank * (module.out_features + (module.in_features if copied_a else 0)) * size
            blocks.setdefault(id(base), {})[module.parameter_name] = (0, kept)
            found["expert_inputs"] += per_token * (module.in_features + rank) * size
            continue
        copy = param.numel() * size
        cast = sum(p.numel() for p in factors if p.dtype != param.dtype) * size
        blocks.setdefault(id(base), {})[module.parameter_name] = (copy, copy + cast)
        found["expert_inputs"] += per_token * module.in_features * size
    for key, sizes in blocks.items():  # in model order; each block's tensors in their declared (forward) order
        found["expert_blocks"].append([sizes[n] for n in order[key] if n in sizes])
    return ids


def expert_lora_bytes(blocks: list[list[tuple[int, int]]], checkpointing: bool) -> int:
    """The peak of what the expert LoRA keeps (:func:`_expert_lora`) in one step. Backward takes a block's tensors in
    reverse order: when it reaches one, that tensor's gradient (a copy's size on peft's path, none on the grouped
    one) joins what the tensors not yet backpropagated keep. Without checkpointing every block keeps its tensors from
    the forward, so the last block's backward sees them all; with it only the block being recomputed has any.
    Measured on one Qwen3-30B-A3B block at 512 tokens, r=16 (benchmarks/RESULTS.md, "Expert LoRA memory (issue
    #42)"): the grouped path saved exactly what this counts with the inputs (36.2 MiB above the frozen experts' in
    bf16, 72.5 in fp32), and its step peaked 84.3 and 73.6 MiB above theirs (bf16 backward's transients, one block
    at a time, not counted); peft's path peaked 1,546 MiB above in bf16 (counted: 1,536 + 22 MiB of inputs),
    3,086 in fp32 (3,072 + 44)."""
    held = peak = 0
    for tensors in blocks:
        kept = 0
        for copy, keeps in tensors:
            kept += keeps
            peak = max(peak, held + kept + copy)
        if not checkpointing:
            held += kept
    return peak


def _layer_bytes(dims: tuple, found: dict[str, Any], *, device: str, autocast: bool) -> float:
    return _dense_layer_bytes(dims, found, device=device, autocast=autocast) + found["expert_inputs"] / dims[1]


def _dense_layer_bytes(dims: tuple, found: dict[str, Any], *, device: str, autocast: bool) -> float:
    h, layers, heads, q_dim, kv_dim, inter, _ = dims
    res = found["res"]
    lin = 2 if autocast or res == 2 else 4  # what linear layers output
    norm = 4 + (res if found["norms_train"] else 0)  # bytes per element, per norm
    if found["bnb_bits"] == 4 and lin == 2:  # 8-bit layers keep their input (not modeled apart)
        return _bnb_layer_bytes(h, q_dim, kv_dim, heads, inter, res, norm, layers, found["adapted"],
                                autocast=autocast, cuda=device == "cuda")
    # On a 16-bit base peft casts each adapted layer's input to the (fp32) adapter's dtype;
    # under autocast that copy is 16-bit again.
    lora_copy = 0 if lin == 4 else (2 if autocast else 4)
    per_layer = 2 * norm * h + (3 * q_dim + h + 2 * kv_dim + 4 * inter) * lin
    return per_layer + (found["lora_outputs"] * 4 + found["lora_inputs"] * lora_copy) / layers


def split_dims(dims: tuple, row_split: int = 1, tp_size: int = 1) -> tuple:
    """A rank's share of :func:`_dims`, per token of its slice of the row, under the row split (Ulysses'
    ``sp_size``, or ``cp_size``) and tensor parallelism.

    Ulysses gives each of ``row_split`` ranks ``1/row_split`` of the row's columns, and inside attention
    (an all-to-all) the whole row for ``heads/row_split`` heads: per token of the slice, query, output and
    key/value are as wide as without the split, but key/value heads fewer than ``row_split`` are copied, a
    whole one to each rank (``max(kv_heads, row_split)`` heads' width). Tensor parallelism splits the
    attention heads, the key/value heads and the MLP width of the sharded projections (transformers'
    ``tp_plan``: q, k, v, gate and up column-wise, o and down row-wise) ``tp_size`` ways; the norms and
    the residual stream stay whole."""
    h, layers, heads, q_dim, kv_dim, inter, vocab = dims
    if row_split > 1:
        head_dim = q_dim // max(heads, 1)
        kv_heads = kv_dim // max(head_dim, 1)
        kv_dim = max(kv_heads, row_split) * head_dim
    if tp_size > 1:
        heads, q_dim, kv_dim, inter = (max(1, x // tp_size) for x in (heads, q_dim, kv_dim, inter))
    return h, layers, heads, q_dim, kv_dim, inter, vocab


def layer_activation_bytes(model_config: Any, model: Any = None, *, device: str = "cpu",
                           precision: str = "fp32") -> float:
    """Bytes a decoder layer saves for backward per token (the average over the layers), as
    :func:`trainer_activation_bytes` counts them."""
    autocast = precision in ("bf16", "fp16")
    return _layer_bytes(_dims(model_config), _scan(model, autocast), device=device, autocast=autocast)


def trainer_activation_bytes(trainer: Any, model_config: Any, batch_size: int, seq_len: int, checkpointing: bool,
                             *, model: Any = None, device: str = "cpu", precision: str = "fp32",
                             row_split: int = 1, tp_size: int = 1) -> int:
    """Peak activation memory of one training step of a decoder-only transformer under TRL.

    Per layer, the tensors autograd saves (counted with saved-tensor hooks on Llama, full and
    LoRA): each of the two norms keeps its fp32 input, and its output when its weight trains;
    then query, attention output, o_proj input and one more hidden-width tensor, key and value,
    and four MLP-width tensors (gate, up, activation, product). LoRA keeps its A outputs, and
    on a 16-bit base a copy of each adapted layer's input in the adapter's dtype; on a 4-bit
    bitsandbytes base where 16 bits are involved, :func:`_bnb_layer_bytes`. A LoRA on expert
    parameters (peft's ``ParamWrapper``): what :func:`expert_lora_bytes` counts (ftcore's grouped path: factor
    copies; peft's: the expert stack's copies and a gradient) and the experts' inputs (and rank-r
    intermediates), per :func:`_expert_lora`. Under autocast, the 16-bit copies of the trainable fp32 weights
    that autocast caches through the forward. Then
    the loss's working set: the trainer's ``loss_kernel`` (sft, pretrain), else TRL's fused LM
    head. With checkpointing only each layer's input is kept, and one layer at a time is
    recomputed in backward, with its gradients. Without it, on CPU, the last layer's gradients in backward
    come on top of everything saved (``_CPU_BACKWARD_LAYERS``).

    Per rank under sequence (``row_split``: Ulysses' ``sp_size``, or ``cp_size``) and tensor parallelism
    (``tp_size``): every tensor above for the rank's ``ceil(seq_len / row_split)`` columns, widths as
    :func:`split_dims` gives them.
    """
    dims = split_dims(_dims(model_config), row_split, tp_size)
    seq_len = -(-seq_len // max(row_split, 1))
    h, layers, _, _, _, _, vocab = dims
    autocast = precision in ("bf16", "fp16")
    found = _scan(model, autocast)
    res, head_grad, cast_cache, lora_widths = found["res"], found["head_grad"], found["cast_cache"], \
        found["lora_widths"]
    lin = 2 if autocast or res == 2 else 4  # what linear layers output
    tokens = batch_size * seq_len
    norm = 4 + (res if found["norms_train"] else 0)  # bytes per element, per norm
    per_layer = tokens * _layer_bytes(dims, found, device=device, autocast=autocast)
    tiled = bool(getattr(getattr(trainer, "options", None), "tiled_mlp", False)) and not found["expert_blocks"] \
        and not (found["bnb_bits"] == 4 and lin == 2)
    shard, untiled = 0, per_layer
    if tiled:
        # DeepSpeed's TiledMLP keeps only the MLP's input (the norm's output, which the layer keeps anyway) and
        # runs one shard of ceil(seq_len / hidden) at a time again in backward: its four MLP-wide tensors (and its
        # LoRA layers' rank-wide outputs and input copies) leave the per-layer count, and one shard's, with their
        # gradients, come on top once.
        lora_copy = 0 if lin == 4 else (2 if autocast else 4)
        mlp_lora = sum(rank * 4 + width * lora_copy for rank, width, _ in found["mlp_lora"]) / max(layers, 1)
        per_layer -= tokens * (4 * dims[5] * lin + mlp_lora)
        shards = -(-seq_len // max(h, 1))
        shard = 2 * batch_size * -(-seq_len // shards) * 4 * dims[5] * lin
    if row_split > 1:
        # Ulysses keeps one more query-wide tensor a layer (its all-to-all's layout copies): saved-tensor hooks on
        # benchmarks/sequence_parallel_memory.py's Llama under sp_size 2 counted that much more than for the same
        # columns in one process (4,096 tokens a rank, 4 layers: 4.6 MiB).
        per_layer += tokens * dims[3] * lin
    final_norm = tokens * h * norm
    rows = batch_size * max(seq_len - 1, 1)
    kernel = _loss_kernel(trainer, device)
    if kernel in ("chunked", "liger"):
        # The trained rows' hidden states (a copy), their fp32 gradient, and the chunk's working set;
        # a trained head's fp32 gradient is accumulated in the forward pass.
        if kernel == "liger":
            # Liger's fused linear cross-entropy (not measured here): chunks of next_pow2(rows / ceil(vocab /
            # hidden)) rows, about the hidden states' size, its logits in the compute dtype, the gradient
            # written over them.
            chunk_rows = 1 << (math.ceil(rows / math.ceil(max(vocab, 1) / h)) - 1).bit_length()
            work = min(rows, chunk_rows) * vocab * lin
        else:
            chunk = loss_chunk_elements(trainer, device)
            work = min(rows, max(1, chunk // max(vocab, 1))) * vocab * 4 * _CHUNK_BUFFERS
        trained_head = getattr(getattr(model, "get_output_embeddings", lambda: None)(), "weight", None)
        head = rows * h * lin + rows * h * 4 + work + head_grad
        if trained_head is not None and trained_head.requires_grad:
            head += trained_head.numel() * 4
    elif kernel == "full":
        head = rows * vocab * (lin + 4 * _FULL_LOGIT_COPIES) + head_grad
    else:
        # TRL's fused LM head: the hidden states it keeps, its fp32 gradient, and its tiles.
        tile = min(rows, _TILE_TOKENS) * min(vocab, _TILE_VOCAB)
        tiles = tile * (_CUDA_TILES * lin if device == "cuda" else _CPU_TILES * 4)
        head = rows * h * lin + rows * h * 4 + tiles + head_grad
    # peft's LoRA forward makes three output-sized temporaries per adapted layer (the base
    # layer's output, the adapter's, the scaled adapter output) before the sum it returns. On
    # CPU glibc's malloc keeps about two of them per layer resident in its heap (measured, with
    # or without checkpointing: the heap grows by that much in the first forward and stays),
    # unless they are above its largest mmap threshold (32 MiB), which it gives back at once.
    # CUDA's caching allocator reuses them.
    retained = 0
    if device != "cuda":
        if tiled:  # an MLP's LoRA temporaries are one shard's
            lora_widths = list(lora_widths)
            for *_, width in found["mlp_lora"]:
                lora_widths.remove(width)
        retained = sum(2 * tokens * w * lin for w in lora_widths if tokens * w * lin <= _MMAP_THRESHOLD_MAX)
    offloaded = device == "cuda" and getattr(getattr(trainer, "options", None), "activation_offloading", False)
    if checkpointing or offloaded:
        # Offloaded, the layers' inputs wait in host memory and come back one at a time for the backward.
        saved = (1 if offloaded else layers) * tokens * h * res + final_norm
        experts = expert_lora_bytes(found["expert_blocks"], True)
        return int(saved + max(head + cast_cache, 2 * per_layer + experts + shard) + retained)
    experts = expert_lora_bytes(found["expert_blocks"], False)
    # CUDA's allocator reuses the blocks. Tiled, the term stays the untiled layer's (benchmarks/tiled_mlp.py).
    backward = _CPU_BACKWARD_LAYERS * (untiled if tiled else per_layer) if device != "cuda" else 0
    return int(layers * per_layer + final_norm + head + cast_cache + retained + experts + backward + shard)


def _loss_kernel(trainer: Any, device: str) -> str:
    """The loss kernel the trainer runs on ``device``: its ``loss_kernel`` option (TRL's fused LM
    head without one), ``auto`` resolved as sft/pretrain resolve it (``device_defaults.loss_kernel_for``): the
    device's first default that runs there, Liger only on CUDA with liger-kernel installed."""
    from ftcore_plugins.common.device_defaults import loss_kernel_for

    o = getattr(trainer, "options", None)
    kernel = getattr(o, "loss_kernel", "trl")
    if kernel == "auto":
        kernel = loss_kernel_for(device)
    if kernel == "chunked" and getattr(o, "liger", False):
        kernel = "liger"
    return kernel


def loss_chunk_elements(trainer: Any, device: str) -> int:
    """Logits per chunk of the chunked loss on ``device``: the trainer class's own
    ``loss_chunk_elements`` where it sets one, else the device's default."""
    from ftcore_plugins.common.device_defaults import defaults

    own = getattr(trainer, "loss_chunk_elements", None)
    return defaults(device).loss_chunk_elements if own is None else int(own)


def trainer_optimizer_bytes(trainer: Any, params: list, *, device: str = "cpu") -> tuple[int, int]:
    """``(state, step temporaries)`` for ``params`` (the trainable parameters). torch's Adam
    runs ``foreach`` on CUDA, which materialises intermediates such as sqrt(v) for every
    parameter at once (one copy of the parameters' size), and one parameter at a time on CPU
    (about two copies of the largest parameter)."""
    from ftcore_plugins.common.device_defaults import optimizer_for

    name = optimizer_for(trainer.options.optimizer, device)  # auto: the device's AdamW, as the trainers resolve it
    n = sum(p.numel() for p in params)
    own = sum(p.numel() * p.element_size() for p in params)
    largest = max((p.numel() * p.element_size() for p in params), default=0)
    if name in _EIGHT_BIT:
        return int(_EIGHT_BIT[name] * (n + n / 2048 * 4)), largest
    if name.startswith("adafactor"):
        return int(sum((sum(p.shape) if p.dim() >= 2 else p.numel()) * 4 for p in params)), 2 * largest
    copies = _STATE_COPIES.get(name, 2)
    temporaries = 2 * largest
    if device == "cuda" and "fused" not in name and copies:
        temporaries = own
    return int(copies * own), int(temporaries)


def trainer_runtime_bytes(trainer: Any, *, device: str = "cpu") -> int:
    """The training libraries' imports (done here, so the caller's measured process memory
    includes them), plus what a run adds beyond them."""
    import datasets  # noqa: F401
    import trl  # noqa: F401
    from trl import SFTConfig, SFTTrainer  # noqa: F401  (trl imports lazily)

    return _CUDA_RUNTIME if device == "cuda" else _CPU_RUNTIME


class TrainerMemory:
    """Mixin for trainers that train through TRL's SFTTrainer (``sft``, ``pretrain``): the
    optional methods ``ftcore estimate`` asks a trainer."""

    def memory_settings(self, *, device: str = "cpu") -> dict[str, Any]:
        return trainer_memory_settings(self, device=device)

    def activation_bytes(self, model_config: Any, batch_size: int, seq_len: int, checkpointing: bool, *,
                         model: Any = None, device: str = "cpu", precision: str = "fp32", row_split: int = 1,
                         tp_size: int = 1) -> int:
        return trainer_activation_bytes(self, model_config, batch_size, seq_len, checkpointing, model=model,
                                        device=device, precision=precision, row_split=row_split, tp_size=tp_size)

    def optimizer_bytes(self, params: list, *, device: str = "cpu") -> tuple[int, int]:
        return trainer_optimizer_bytes(self, params, device=device)

    def runtime_bytes(self, *, device: str = "cpu") -> int:
        return trainer_runtime_bytes(self, device=device)
