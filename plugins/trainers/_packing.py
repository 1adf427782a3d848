"""Attention for packed batches that costs what the samples cost, with SDPA too.

With ``packing = true`` TRL packs samples best-fit into bins of ``max_length`` and its padding-free
collator concatenates a batch's bins into one row, with position ids restarting per sample and the
sample boundaries as ``cu_seq_lens_q``/``cu_seq_lens_k``. The varlen flash kernels use those
boundaries. SDPA and eager attention instead get a block-diagonal mask over the whole row
(batch x max_length positions) and compute every pair in it, so their cost grows with the square of
the row. :func:`per_sample_attention` runs SDPA's causal kernel sample by sample on such a row: the
same result, for the cost of the samples alone. Training a packed stage selects it in place of
``sdpa`` (:func:`per_sample_sdpa`); every other input, and every model feature it does not handle,
goes to transformers' own SDPA with the mask transformers builds.
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
        return [int(e) for e in cu_seq_lens.tolist()]
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


def packed_attention(model: Any) -> str:
    """The attention a packed (padding-free) batch gets on ``model``: ``"per-sample sdpa"`` where
    :func:`per_sample_sdpa` applies, else the model's own kernel (flash kernels are varlen already,
    flex attention's block mask skips the pairs across samples, eager is what the plan asked for)."""
    kernel = getattr(getattr(model, "config", None), "_attn_implementation", None) or "eager"
    return "per-sample sdpa" if kernel == "sdpa" else kernel


@contextlib.contextmanager
def per_sample_sdpa(model: Any, packed: bool) -> Iterator[str | None]:
    """While training a ``packed`` stage on an SDPA ``model``, attend sample by sample; the model's
    own kernel is back afterwards (for evaluation, generation and what is saved). Yields the
    attention path packed batches take, or None without packing."""
    if not packed:
        yield None
        return
    path = packed_attention(model)
    if path != "per-sample sdpa":
        yield path
        return
    register()
    model.set_attn_implementation(PER_SAMPLE_SDPA)
    try:
        yield path
    finally:
        model.set_attn_implementation("sdpa")
