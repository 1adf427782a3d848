"""``padding_free = true`` for ``dpo``, ``kto`` and ``orpo``: each batch's sequences run as one row.

TRL 1.16 pads a preference batch's sequences to the longest (DPO: chosen then rejected; KTO:
completions and their KL counterparts; ORPO: chosen then rejected), and its own ``padding_free``
is disabled for DPO ("temporarily unavailable after a refactor") and absent from KTO and ORPO.
:func:`with_padding_free` keeps TRL's collator and loss and changes only the model call, while a
stage trains: the forward drops the padding, runs the sequences concatenated in one row with
position ids restarting per sequence (attention within each: SDPA per sample, see ``_packing``),
and puts the outputs back in the padded layout TRL's loss reads. Two calls are rewritten:

- TRL's fused-LM-head call (DPO, KTO: ``labels`` and ``fused_lm_head=True``): the per-token
  log-probs and statistics come back per row, zero past each row's end, as TRL's own would be;
- a plain call (ORPO: ``model(input_ids, attention_mask=...)``): the logits come back per row,
  zero at the padding, whose positions TRL's ORPO loss masks out.
"""

from __future__ import annotations

import types
from typing import Any

PER_TOKEN = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")
ALLOWED = {"use_cache", "output_router_logits"}  # other model inputs (a cache, images) keep the padded call


class OneRow:
    """What the patched forwards share: whether they run one-row (only while training) and what they
    did: the one-row forwards (``forwards``) and the pad positions they left out (``pads``)."""

    def __init__(self) -> None:
        self.on = False
        self.forwards = 0
        self.pads = 0


def one_row_forward(module: Any, state: OneRow) -> None:
    """Patch ``module.forward`` (a per-instance closure, as TRL's own patches, so that
    ``strip_forward_patches`` removes it): while ``state.on``, calls on right-padded rows run as one row."""
    original = module.forward

    def forward(self, input_ids=None, attention_mask=None, labels=None, fused_lm_head=False, **kwargs):
        fused = fused_lm_head and labels is not None
        plain = not fused_lm_head and labels is None
        rows = right_padded(attention_mask) if state.on and input_ids is not None and (fused or plain) \
            and not set(kwargs) - ALLOWED else None
        if rows is None:
            return original(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                            fused_lm_head=fused_lm_head, **kwargs)
        import torch

        keep = attention_mask.bool()
        state.forwards += 1
        state.pads += int(keep.numel() - rows.sum())
        starts = torch.cat([rows.new_zeros(1), rows.cumsum(0)[:-1]])
        positions = torch.arange(keep.size(1), device=keep.device).expand_as(keep)[keep]
        edges = torch.cat([rows.new_zeros(1), rows.cumsum(0)]).to(torch.int32)
        longest = int(rows.max())
        packed = {"position_ids": positions[None], "cu_seq_lens_q": edges, "cu_seq_lens_k": edges,
                  "max_length_q": longest, "max_length_k": longest}
        if plain:
            out = original(input_ids=input_ids[keep][None], attention_mask=None, **packed, **kwargs)
            logits = out.logits.new_zeros(*keep.shape, out.logits.size(-1))
            logits[keep] = out.logits[0]
            out["logits"] = logits
            return out
        flat_labels = labels[keep].clone()
        flat_labels[starts] = -100  # a sequence's first token is not predicted from the one before it
        out = original(input_ids=input_ids[keep][None], labels=flat_labels[None], fused_lm_head=True,
                       **packed, **kwargs)
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


def with_padding_free(trainer_cls: type, hide: tuple[str, ...] = ()) -> type:
    """A subclass of the TRL trainer class ``trainer_cls`` whose policy and reference forwards run
    each batch as one row, and attend per sequence, while it trains. ``hide``: metrics that averaged
    the padding (and their ``eval_`` forms), dropped where the trainer stores them (ORPO's
    ``store_metrics``), since without padding they would not be true."""
    import contextlib

    from ftcore_plugins.trainers._packing import per_sample_sdpa

    class PaddingFree(trainer_cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.one_row = OneRow()
            for model in self._models():
                one_row_forward(model, self.one_row)

        def _models(self) -> list:
            models = (self.model, getattr(self, "ref_model", None))
            return list({id(m): m for m in models if m is not None}.values())

        @property
        def padding_free_counts(self) -> dict[str, int]:  # for the stage's summary
            return {"padding_free_forwards": self.one_row.forwards, "padding_free_pads": self.one_row.pads}

        def train(self, *args, **kwargs):
            with contextlib.ExitStack() as attention:
                for model in self._models():
                    attention.enter_context(per_sample_sdpa(model, packed=True))
                self.one_row.on = True
                try:
                    return super().train(*args, **kwargs)
                finally:
                    self.one_row.on = False

        def store_metrics(self, metrics, *args, **kwargs):  # where ORPO keeps a step's metrics until it logs
            metrics = {k: v for k, v in metrics.items() if k.removeprefix("eval_") not in hide}
            return super().store_metrics(metrics, *args, **kwargs)

    PaddingFree.__name__ = PaddingFree.__qualname__ = f"{trainer_cls.__name__}PaddingFree"
    return PaddingFree


def padding_free_problems(component: Any, plan: Any) -> list[str]:
    """Validation of ``padding_free = true``: prompt-learning adapters prepend their virtual tokens to
    each row, which would put them once per batch rather than once per sequence."""
    if not component.options.padding_free:
        return []
    return [f"padding_free: stage '{stage.name}' uses {stage.adapter.name}, whose virtual tokens would come once "
            "per row, not once per sequence; set padding_free = false"
            for stage in plan.stages if stage.trainer.options is component.options
            and stage.adapter.name in ("prompt_tuning", "prefix_tuning")]
