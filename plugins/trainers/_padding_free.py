"""``padding_free = true`` for ``dpo``: each batch's chosen and rejected sequences run as one row.

TRL 1.16's DPOTrainer pads the batch's 2 x batch_size sequences (chosen, then rejected) to the
longest, and its ``padding_free`` option is disabled ("temporarily unavailable after a refactor").
:func:`with_padding_free` keeps TRL's collator and loss and changes only the model call: the forward
TRL makes with its fused LM head drops the padding, runs the sequences concatenated in one row with
position ids restarting per sequence (attention within each: SDPA per sample, see ``_packing``), and
puts the per-token outputs back in the padded layout TRL's loss reads. The policy's forward and the
reference's both run that way.
"""

from __future__ import annotations

import types
from typing import Any

PER_TOKEN = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")


def one_row_forward(module: Any, counts: dict[str, int]) -> None:
    """Patch ``module.forward`` (a per-instance closure, as TRL's own patches, so that
    ``strip_forward_patches`` removes it): fused-head calls on right-padded rows run as one row.
    ``counts`` gains the one-row forwards (``forwards``) and the pad positions they left out (``pads``)."""
    original = module.forward

    def forward(self, input_ids=None, attention_mask=None, labels=None, fused_lm_head=False, **kwargs):
        rows = right_padded(attention_mask) if fused_lm_head and input_ids is not None and labels is not None \
            and not set(kwargs) - {"use_cache", "output_router_logits"} else None
        if rows is None:
            return original(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                            fused_lm_head=fused_lm_head, **kwargs)
        import torch

        keep = attention_mask.bool()
        counts["forwards"] = counts.get("forwards", 0) + 1
        counts["pads"] = counts.get("pads", 0) + int(keep.numel() - rows.sum())
        starts = torch.cat([rows.new_zeros(1), rows.cumsum(0)[:-1]])
        flat_labels = labels[keep].clone()
        flat_labels[starts] = -100  # a sequence's first token is not predicted from the one before it
        positions = torch.arange(keep.size(1), device=keep.device).expand_as(keep)[keep]
        edges = torch.cat([rows.new_zeros(1), rows.cumsum(0)]).to(torch.int32)
        longest = int(rows.max())
        out = original(input_ids=input_ids[keep][None], position_ids=positions[None], labels=flat_labels[None],
                       fused_lm_head=True, cu_seq_lens_q=edges, cu_seq_lens_k=edges, max_length_q=longest,
                       max_length_k=longest, **kwargs)
        for name in PER_TOKEN:
            value = getattr(out, name, None)
            if value is not None:
                out[name] = to_rows(value, rows, starts, keep.size(1) - 1)
        return out

    module.forward = types.MethodType(forward, module)


def right_padded(mask: Any) -> Any:
    """Each row's length when ``mask`` is a 2D mask of right-padded rows (real tokens first), else None."""
    import torch

    if mask is None or mask.dim() != 2:
        return None
    lengths = mask.sum(1)
    if not torch.equal(mask.bool(), torch.arange(mask.size(1), device=mask.device)[None] < lengths[:, None]):
        return None
    return lengths


def to_rows(flat: Any, rows: Any, starts: Any, width: int) -> Any:
    """A per-token output of the one-row forward (``[1, T - 1]``: position j scores token j + 1) as
    the padded rows' (``[rows, width]``), zero past each row's last scored token."""
    import torch

    column = torch.arange(width, device=flat.device)
    valid = column[None] < (rows[:, None] - 1)
    source = (starts[:, None] + column[None]).clamp(max=flat.size(1) - 1)
    out = flat[0][source]
    return torch.where(valid, out, torch.zeros((), dtype=out.dtype, device=out.device))


def with_padding_free(trainer_cls: type) -> type:
    """A subclass of TRL's ``DPOTrainer`` class ``trainer_cls`` whose policy and reference forwards
    run each batch as one row, and attend per sequence while training."""
    import contextlib

    from ftcore_plugins.trainers._packing import per_sample_sdpa

    class PaddingFree(trainer_cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.padding_free_counts: dict[str, int] = {}
            for model in (self.model, self.ref_model):
                if model is not None:
                    one_row_forward(model, self.padding_free_counts)

        def train(self, *args, **kwargs):
            with contextlib.ExitStack() as attention:
                for model in {id(m): m for m in (self.model, self.ref_model) if m is not None}.values():
                    attention.enter_context(per_sample_sdpa(model, packed=True))
                return super().train(*args, **kwargs)

    PaddingFree.__name__ = PaddingFree.__qualname__ = f"{trainer_cls.__name__}PaddingFree"
    return PaddingFree
