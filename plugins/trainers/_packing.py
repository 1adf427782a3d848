"""The attention of packed batches, chosen per device: library kernels on a GPU, SDPA per sample on a CPU.

With ``packing = true`` TRL packs samples best-fit into bins of ``max_length``. How a batch of bins
reaches the model, and which attention runs on it, is the stage's ``packed_attention``:

- ``varlen``: TRL's padding-free collator concatenates the bins into one row, with the sample
  boundaries (``cu_seq_lens_q``/``cu_seq_lens_k``, ``max_length_q``) computed on the host; the model
  runs flash attention's varlen kernel (``flash_attention_2``; needs CUDA and ``flash-attn``).
- ``flex`` and ``sdpa_block``: one row per bin (:class:`BinnedBatches`), position ids restarting per
  sample and no attention mask, so transformers builds the packed-sequence mask once per forward
  pass, shared by every layer (a ``BlockMask`` for ``flex_attention``, a block-diagonal mask of
  ``max_length`` squared per bin for SDPA), sliding windows included. No loop over samples. flex's
  rows are all ``max_length`` rounded up to 128 wide (:func:`fixed_width`): it is compiled, and a
  width it has not seen is a recompilation.
- ``sdpa_per_sample``: the one row of ``varlen``, and SDPA's causal kernel run sample by sample
  (:func:`per_sample_attention`): on a CPU the cheapest (``benchmarks/RESULTS.md``, Packing), on a
  GPU thousands of small kernels a step.
- ``auto``: the first of the device's order (``plugins/common/device_defaults.py``) that runs here.

A model loaded with another kernel than SDPA keeps it: flash kernels take the row, flex attention
and eager attention the bins. The model's own kernel is back once the stage has trained.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

PER_SAMPLE_SDPA = "ftcore_per_sample_sdpa"


def per_sample_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                         dropout: float = 0.0, scaling: float | None = None, **kwargs: Any) -> tuple[Any, None]:
    """A transformers attention function: on one unpadded row without a cache (what
    :func:`per_sample_mask` leaves without a mask), causal SDPA within each sample, the samples told
    by ``cu_seq_lens_q`` (TRL's padding-free collator) or by the position ids restarting; on any
    other input, transformers' ``sdpa_attention_forward``."""
    import torch
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    length = query.shape[2]
    if (attention_mask is not None or query.shape[0] != 1 or key.shape[2] != length or length == 1
            or not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    edges = sample_edges(length, kwargs.get("cu_seq_lens_q"), kwargs.get("position_ids"))
    window = kwargs.get("sliding_window")
    if any(kwargs.get(k) is not None for k in ("softcap", "s_aux", "position_bias", "cache")):
        # What only transformers' SDPA path handles: give it the mask it would have built.
        mask = block_causal_mask(edges, window, query.device)
        return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    outputs = []
    for start, end in zip(edges[:-1], edges[1:]):
        q, k, v = query[:, :, start:end], key[:, :, start:end], value[:, :, start:end]
        if window is not None and end - start > window:
            mask = block_causal_mask([0, end - start], window, query.device)
            outputs.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                                            scale=scaling))
        else:
            outputs.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling,
                                                                            is_causal=True))
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def sample_edges(length: int, cu_seq_lens: Any, position_ids: Any) -> list[int]:
    """Where each sample of a packed row starts, and the row's end."""
    if cu_seq_lens is not None:
        # Every layer gets the same tensor: read it once a forward pass (on a GPU, one host sync, not one a layer).
        edges = getattr(cu_seq_lens, "_ftcore_edges", None)
        if edges is None:
            edges = cu_seq_lens._ftcore_edges = [int(e) for e in cu_seq_lens.tolist()]
        return edges
    if position_ids is not None:
        ids = position_ids.reshape(-1)
        starts = (ids[1:] - ids[:-1] != 1).nonzero().flatten() + 1
        return [0, *starts.tolist(), length]
    return [0, length]


def block_causal_mask(edges: list[int], window: int | None, device: Any) -> Any:
    """The boolean mask ``[1, 1, L, L]`` of causal attention within each sample (and within
    ``window`` tokens back, as transformers' sliding window: ``q - k < window``)."""
    import torch

    sample = torch.repeat_interleave(torch.arange(len(edges) - 1, device=device),
                                     torch.tensor(edges, device=device).diff())
    position = torch.arange(edges[-1], device=device)
    back = position[:, None] - position[None, :]
    mask = (sample[:, None] == sample[None, :]) & (back >= 0)
    if window is not None:
        mask &= back < window
    return mask[None, None]


def per_sample_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                    attention_mask: Any = None, allow_is_causal_skip: bool = True, **kwargs: Any) -> Any:
    """The mask function paired with :func:`per_sample_attention`: none for one unpadded causal row
    without a cache (the attention finds the samples itself), else transformers' ``sdpa_mask``. It
    skips building a ``(batch x max_length)^2`` mask per forward pass."""
    from transformers.masking_utils import sdpa_mask

    causal = "allow_is_bidirectional_skip" not in kwargs  # only transformers' bidirectional masks pass it
    if batch_size == 1 and attention_mask is None and q_length == kv_length and not q_offset and not kv_offset \
            and causal:
        return None
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, attention_mask=attention_mask, allow_is_causal_skip=allow_is_causal_skip,
                     **kwargs)


def register() -> None:
    """Make :data:`PER_SAMPLE_SDPA` an attention implementation transformers knows."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(PER_SAMPLE_SDPA, per_sample_attention)
    AttentionMaskInterface.register(PER_SAMPLE_SDPA, per_sample_mask)


PACKED_PATHS = ("varlen", "flex", "sdpa_block", "sdpa_per_sample")
# The model's attention while a packed stage trains, for each path.
KERNELS = {"varlen": "flash_attention_2", "flex": "flex_attention", "sdpa_block": "sdpa",
           "sdpa_per_sample": PER_SAMPLE_SDPA}
# A model loaded with another kernel keeps it; the path that kernel takes.
OWN_KERNEL_PATHS = {"flash_attention_2": "varlen", "flash_attention_3": "varlen", "flex_attention": "flex",
                    "eager": "eager"}
BINNED = {"flex", "sdpa_block", "eager"}  # paths that take one row per bin (BinnedBatches)


def path_problem(path: str, device: str) -> str | None:
    """Why packed attention ``path`` cannot run on ``device`` (``cpu``, ``cuda``) here, or None."""
    import importlib.util

    if path == "varlen":
        if device != "cuda":
            return "varlen flash attention needs a CUDA GPU"
        if importlib.util.find_spec("flash_attn") is None:
            return "varlen flash attention needs the flash-attn package, which is not installed"
    if path == "flex":
        if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
            return "flex attention needs torch >= 2.5"
        if device == "cpu":  # torch 2.13: "FlexAttention does not support backward on CPU"
            return "flex attention has no backward pass on a CPU, so it cannot train there"
        from ftcore_plugins.common.device_defaults import triton_problem

        if (problem := triton_problem()) is not None:
            return f"flex attention is compiled to Triton kernels: {problem}"
    return None


def choose_path(option: str, model: Any, device: str) -> str:
    """The path packed batches take on ``model`` when it trains on ``device``: the one its kernel takes when
    that is not SDPA (the plan asked for it); else ``option``, or for ``auto`` the first of the device's
    defaults that runs here and that the model supports."""
    kernel = getattr(getattr(model, "config", None), "_attn_implementation", None) or "eager"
    if kernel != "sdpa":
        return OWN_KERNEL_PATHS.get(kernel, kernel)
    if option != "auto":
        return option
    return next((p for p, why in _auto_paths(model, device) if why is None), "sdpa_per_sample")


def passed_over(option: str, model: Any, device: str, path: str) -> str | None:
    """Why ``auto`` did not take the paths the device prefers to ``path`` (one clause each), or None (nothing
    passed over, or the path is the model's own kernel's, which the plan chose)."""
    kernel = getattr(getattr(model, "config", None), "_attn_implementation", None) or "eager"
    if option != "auto" or kernel != "sdpa":
        return None
    reasons = []
    for candidate, why in _auto_paths(model, device):
        if candidate == path:
            break
        if why is not None:
            reasons.append(f"not {candidate}: {why}")
    return "; ".join(reasons) or None


def _auto_paths(model: Any, device: str) -> list[tuple[str, str | None]]:
    """The device's packed-attention paths in order, each with why it cannot run here on ``model`` (None: it can)."""
    from ftcore_plugins.common.device_defaults import defaults

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    supports = {"varlen": getattr(base, "_supports_flash_attn", False),
                "flex": getattr(base, "_supports_flex_attn", False)}
    return [(p, f"{type(base).__name__} does not support it" if not supports.get(p, True) else path_problem(p, device))
            for p in defaults(device).packed_attention]


# flex attention's kernels work on blocks of 128 positions (its BlockMask's default block size).
FLEX_BLOCK = 128


def fixed_width(path: str, max_length: int | None) -> int | None:
    """The width every binned row of a ``path`` stage is padded to, or None (rows as long as the batch's
    longest bin). flex attention is compiled (transformers compiles it and its block mask), and a new
    width is a new shape to compile for: every batch gets ``max_length`` rounded up to a whole block."""
    if path != "flex" or not max_length:
        return None
    return -(-max_length // FLEX_BLOCK) * FLEX_BLOCK


@contextlib.contextmanager
def attention_for(model: Any, path: str | None) -> Iterator[str | None]:
    """While a packed stage trains on ``path``, the model's attention is that path's kernel; its own is
    back afterwards (for evaluation, generation and what is saved). Yields ``path``."""
    kernel = getattr(model.config, "_attn_implementation", None)
    wanted = KERNELS.get(path or "", kernel)
    if path is None or wanted == kernel:
        yield path
        return
    if wanted == PER_SAMPLE_SDPA:
        register()
    model.set_attn_implementation(wanted)
    try:
        yield path
    finally:
        model.set_attn_implementation(kernel)


@contextlib.contextmanager
def per_sample_sdpa(model: Any, packed: bool) -> Iterator[str | None]:
    """While training a ``packed`` stage on an SDPA ``model``, attend sample by sample on one row (the
    preference trainers' ``padding_free``, whose forwards build that row themselves). Yields the path
    packed batches take (``sdpa_per_sample``, or the model's own kernel's), or None without packing."""
    if not packed:
        yield None
        return
    kernel = getattr(model.config, "_attn_implementation", None) or "eager"
    path = "sdpa_per_sample" if kernel == "sdpa" else OWN_KERNEL_PATHS.get(kernel, kernel)
    with attention_for(model, path):
        yield path


class BinnedBatches:
    """The collator of the binned paths (``flex``, ``sdpa_block``, eager): a batch of packed bins as one
    row each, right-padded to the longest or to a fixed width (never trained), position ids restarting at
    each sample, no attention mask: from those, transformers builds the packed-sequence mask once a
    forward pass. The
    first token of each sample is not predicted from the previous sample (label -100), as in TRL's
    padding-free rows. ``REAL_TOKENS`` counts the positions that are not padding (the stage's
    ``train_tokens``), on the host."""

    REAL_TOKENS = "ftcore_real_tokens"

    def __init__(self, pad_token_id: int, width: int | None = None, rows: int | None = None):
        self.pad_token_id = pad_token_id
        # With a fixed shape (flex, :func:`fixed_width`): every row ``width`` positions, and a batch short
        # of bins (an epoch's last) filled to ``rows`` with rows of padding, trained on nowhere.
        self.width, self.rows = width, rows

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        width = max(self.width or 0, *(len(e["input_ids"]) for e in examples))
        shape = (max(self.rows or 0, len(examples)), width)
        ids = torch.full(shape, self.pad_token_id, dtype=torch.long)
        labels = torch.full(shape, -100, dtype=torch.long)
        positions = torch.arange(width).expand(shape).clone()  # a row of padding alone: one causal "sample"
        for row, example in enumerate(examples):
            length = len(example["input_ids"])
            ids[row, :length] = torch.tensor(example["input_ids"])
            labels[row, :length] = torch.tensor(example.get("labels", example["input_ids"]))
            start, n = 0, 0
            for n in example.get("seq_lengths") or [length]:
                positions[row, start:start + n] = torch.arange(n)
                labels[row, start] = -100
                start += n
            # The padding continues the last sample: it sees that sample, which never sees it (causal).
            positions[row, length:] = torch.arange(n, n + width - length)
        return {"input_ids": ids, "labels": labels, "position_ids": positions,
                self.REAL_TOKENS: sum(len(e["input_ids"]) for e in examples)}


def with_packed_attention(trainer_cls: type, path: str, *, collator: bool = True, width: int | None = None) -> type:
    """A subclass of the TRL ``SFTTrainer`` class ``trainer_cls`` (packing on) whose batches take
    ``path``: with ``collator``, its collator makes one row per bin for the binned paths; given a
    ``width``, every batch is the same shape, a batch's rows of ``width`` positions each (TRL's own makes
    one row for the other paths; without ``collator``, the trainer's collator packs). The model attends
    with the path's kernel while it trains."""
    class PackedAttention(trainer_cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if path in BINNED and collator:
                rows = self.args.per_device_train_batch_size if width else None
                self.data_collator = BinnedBatches(self.data_collator.pad_token_id, width, rows)

        def train(self, *args, **kwargs):
            with attention_for(self.model, path):
                return super().train(*args, **kwargs)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            real = inputs.pop(BinnedBatches.REAL_TOKENS, None)
            before = getattr(self, "_total_train_tokens", 0)
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if real is not None and model.training:
                # The loss counted the bins' positions (TRL: one row's); the real tokens are the collator's count.
                if self.accelerator.num_processes > 1:
                    import torch

                    real = int(self.accelerator.gather_for_metrics(
                        torch.tensor([real], device=inputs["input_ids"].device)).sum().item())
                self._total_train_tokens = before + real // self._tp_size
                self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
            return out

    PackedAttention.__name__ = PackedAttention.__qualname__ = f"{trainer_cls.__name__}Packed"
    return PackedAttention
