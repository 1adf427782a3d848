"""Sequence parallelism (``[distributed] sp_size``): each row split across ``sp_size`` processes by
DeepSpeed's Ulysses, as accelerate and transformers' Trainer run it (ALST, arXiv 2506.13996).

The Trainer does the sharding: accelerate wraps the model's attention (``UlyssesSPAttentionHF``: an
all-to-all turns the sequence shards into head shards around the attention kernel) and the train
dataloader (``UlyssesSPDataLoaderAdapter``: every rank's batch is gathered, and each is then run by all
ranks in turn, a slice of its columns each, with pre-shifted ``shift_labels``). What ftcore adds:

- the batches it needs: position ids in every batch (TRL's collator gives them under sequence
  parallelism), rows padded to a multiple of ``sp_size`` columns (``run_trl``);
- the loss over the whole row: each rank's summed loss over its slice, divided by the trained tokens of
  every slice of the step (``num_items_in_batch``, which the Trainer counts only from ``labels``); the
  slices' gradients add up (DeepSpeed averages over the data-parallel ranks alone), and the value logged
  is the whole rows' (``whole_row_loss``);
- the checks that keep a plan from failing after the model loaded (``plan_problems`` here, the model's
  in ``common/launch.py``'s ``Distributed.model_problems``).

Everything here is imported by ``ftcore validate`` only through the functions that take a plan; torch
is imported inside the others."""

from __future__ import annotations

from typing import Any

# The trainers whose loss is next-token cross-entropy over labelled columns: each rank's slice of the
# row is a slice of the loss. Preference and RL trainers score whole rows (a sequence's log-probability),
# which a slice does not have.
SEQUENCE_PARALLEL_TRAINERS = ("sft", "pretrain")


def row_axis(plan: Any) -> tuple[str, int] | None:
    """The plan's axis that splits rows across processes (``sp_size``, ``cp_size``) and its size, or None."""
    d = getattr(plan, "distributed", None)
    if d is None or d.processes == 1:
        return None
    return ("sp_size", d.sp_size) if d.sp_size > 1 else ("cp_size", d.cp_size) if d.cp_size > 1 else None


def row_multiple(plan: Any) -> int:
    """What the plan's rows are padded to a multiple of: 1, ``sp_size`` (each process an equal slice of the
    columns), or twice ``cp_size`` (torch's context parallel gives each process a head and a tail chunk, which
    balances the causal attention's work)."""
    axis = row_axis(plan)
    return 1 if axis is None else axis[1] * (2 if axis[0] == "cp_size" else 1)


def plan_problems(component: Any, plan: Any) -> list[str]:
    """``check(plan)`` problems of a trainer whose rows the plan splits across processes (no import of
    torch): sequence parallelism (``sp_size``) or context parallelism (``cp_size``)."""
    axis = row_axis(plan)
    if axis is None or not any(s.trainer.options is component.options for s in plan.stages):
        return []
    key, size = axis
    name = f"{'sequence' if key == 'sp_size' else 'context'} parallelism ({key} = {size})"
    o = component.options
    if component.name not in SEQUENCE_PARALLEL_TRAINERS or getattr(component, "compute_loss", None) is not None:
        what = "scores whole rows" if component.name not in SEQUENCE_PARALLEL_TRAINERS else \
            "computes its own loss from whole rows"
        return [f"trainer '{component.name}' {what}, and {name} gives each process a slice of a row; it runs "
                f"with {' or '.join(repr(t) for t in SEQUENCE_PARALLEL_TRAINERS)}, or set {key} = 1 in [distributed]"]
    out = []
    length = getattr(o, "max_length", None)
    if key == "sp_size" and isinstance(length, int) and length % size:
        out.append(f"max_length: {length} is not divisible by sp_size = {size}, and each process takes an equal "
                   f"slice of a row; use a multiple of {size} (e.g. {length - length % size or size})")
    if getattr(o, "packing", False):
        out.append(f"packing: packed samples must be kept apart inside attention, which {name} leaves to the "
                   "attention kernel, and not every kernel does; set packing = false")
    kernel = getattr(o, "loss_kernel", "auto")
    if kernel in ("full", "trl"):
        out.append(f"loss_kernel: \"{kernel}\" needs a whole row's logits, and {name} gives each process a "
                   "slice; use \"auto\" or \"chunked\"")
    return out


def parallelism_config(size: int, model: Any) -> Any:
    """accelerate's ``ParallelismConfig`` for Ulysses over ``size`` processes, on the model's attention
    kernel; rows may change length from batch to batch."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    attention = getattr(getattr(model, "config", None), "_attn_implementation", None) or "sdpa"
    return ParallelismConfig(sp_backend="deepspeed", sp_size=size, sp_handler=DeepSpeedSequenceParallelConfig(
        sp_seq_length_is_variable=True, sp_attn_implementation=attention))


def enabled(trainer: Any) -> bool:
    pc = getattr(trainer.accelerator, "parallelism_config", None)
    return pc is not None and pc.sp_backend == "deepspeed" and pc.sp_enabled


def trained_tokens(trainer: Any, batches: list[dict[str, Any]], device: Any) -> Any:
    """The trained tokens of a step's micro-batches on every rank (``num_items_in_batch``): under Ulysses a
    batch carries ``shift_labels`` (its slice of the row), not ``labels``, which the Trainer counts."""
    import torch

    count = sum((b["shift_labels"] != -100).sum() for b in batches) if batches else torch.tensor(0)
    count = count.to(device)
    return trainer.accelerator.gather(count).sum() if trainer.args.world_size > 1 else count


def whole_row_loss(loss: Any) -> Any:
    """The rank's loss (its slice's share of the step's loss) with the value of the whole rows' loss: summed
    over the ranks that share the rows, which the Trainer then logs as it logs any loss. The gradient stays
    the slice's own: DeepSpeed adds the slices' gradients up."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    total = loss.detach().clone()
    dist.all_reduce(total, group=groups._get_sequence_parallel_group())
    return loss + (total - loss.detach())


def contiguous(inputs: dict[str, Any]) -> dict[str, Any]:
    """A slice of the columns of a batch of several rows is not contiguous; transformers' loss views
    ``shift_labels`` flat, which needs it to be."""
    import torch

    return {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
