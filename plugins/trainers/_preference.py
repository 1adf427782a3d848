"""What the preference trainers (``dpo``, ``kto``, ``orpo``, ``reward``) share beyond the scoring in
:mod:`ftcore_plugins.common.preference`: the data check at validation and on the loaded rows, the
length report, the reference policy, and training against it with TRL."""

from __future__ import annotations

import copy
import json
from typing import Any

from ftcore.errors import FtcoreError

from ftcore_plugins.common.model import strip_forward_patches
from ftcore_plugins.common.preference import (FORMAT_KIND, answer_logps, kind_of_columns, pair_metrics, render,
                                              tokenize, unpair, wrong_kind)


def check_data(component: Any, plan: Any, accepts: tuple[str, ...]) -> list[str]:
    """``check(plan)`` problems for the stages that use this trainer, for the data kinds we can
    tell without loading the data: an explicit ``format``, or the first row of a JSON Lines file;
    and the shared training options' problems."""
    from ftcore_plugins.trainers._training import training_problems

    problems = training_problems(component, plan)
    for stage in plan.stages:
        if stage.trainer.options is not component.options:
            continue
        for key, ref in (("data", stage.data), ("eval_data", stage.eval_data)):
            name = (ref or "").partition(":")[0]
            source = plan.data.get(name)
            kind = _declared_kind(source) if source is not None else None
            if kind is not None and kind not in accepts:
                problems.append(f"{key}: " + wrong_kind(component.name, accepts, f"[data.{name}] holds {kind} rows"))
    return problems


def _declared_kind(source: Any) -> str | None:
    from ftcore_plugins.common import formats as _formats

    options = source.options
    fmt = getattr(options, "format", None)
    if fmt in FORMAT_KIND:
        return FORMAT_KIND[fmt]
    if fmt != "auto":
        return None
    try:
        paths = [p for p in source.create().inputs() if str(p).endswith(".jsonl")]
    except Exception:
        return None
    if not paths:
        return None
    try:
        with open(paths[0], encoding="utf-8") as fh:
            line = next((line for line in fh if line.strip()), None)
        row = json.loads(line) if line else None
    except (OSError, ValueError):
        return None
    kind = _formats.kind_of(row, "auto", columns=getattr(options, "columns", None) or None)
    return {"preference": "pairs", "unpaired_preference": "unpaired"}.get(kind, kind)


def require_data(ctx: Any, trainer: str, accepts: tuple[str, ...], images: bool = False) -> str:
    """The kind of the stage's rows ("pairs" or "unpaired"); a one-line error when it is not one
    this trainer takes. Train and eval data must be of a kind the trainer takes (not the same one).
    Rows with images are refused unless ``images`` (the trainer takes pairs with images)."""
    kinds = []
    for label, data in (("data", ctx.train_data), ("eval_data", ctx.eval_data)):
        if data is None:
            continue
        kind = kind_of_columns(data.column_names)
        if "images" in data.column_names and not (images and kind == "pairs"):
            takes = "sft does" if trainer == "dpo" else "dpo (on preference pairs) and sft do"
            raise FtcoreError(f"stage {ctx.stage}: trainer '{trainer}' does not train on rows with images yet (its "
                              f"{label} has an 'images' column); {takes} (docs/vision.md)")
        if kind not in accepts:
            raise FtcoreError(f"stage {ctx.stage}: " + wrong_kind(
                trainer, accepts, f"its {label} has the columns {', '.join(sorted(data.column_names))}"))
        kinds.append(kind)
    return kinds[0]


def length_report(ctx: Any, texts: dict[str, Any], max_length: int, *, style: str,
                  drops_whole_row: bool = False, measured: dict[str, list[tuple[int, int]]] | None = None
                  ) -> dict[str, list]:
    """Tokenize the rendered splits, report per split how many rows are kept, truncated (an answer
    cut at ``max_length``) and dropped (the prompt alone fills ``max_length``; with
    ``drops_whole_row``, any sequence over it, as TRL's reward trainer does), with length
    percentiles; return the ids of each split. ``measured``: each split's rows as (prompt tokens, longer
    answer's tokens), measured by the caller (pairs with images: their images expanded) in place of
    tokenizing ``texts``; no ids are returned for those."""
    out, shown = {}, []
    for label, rows in texts.items():
        if rows is None:
            continue
        ids = tokenize(ctx.tokenizer, rows, style=style) if measured is None else None
        sizes = measured[label] if ids is None else [(len(p), max(len(a) for a in answers)) for p, answers in ids]
        longest = [p + a for p, a in sizes]
        too_long = [n > max_length for n in longest]
        dropped = sum(too_long) if drops_whole_row else sum(p >= max_length for p, _ in sizes)
        ordered = sorted(longest) or [0]
        stats = {"rows": len(sizes), "kept": len(sizes) - dropped, "truncated": 0 if drops_whole_row else
                 sum(too_long) - dropped, "dropped": dropped, "max_length": max_length,
                 "length_p50": ordered[len(ordered) // 2], "length_p90": ordered[(9 * len(ordered)) // 10],
                 "length_max": ordered[-1]}
        ctx.reporter.data_report(f"{ctx.stage}/{label}", stats)
        ctx.reporter.log(ctx.stage, {f"data/{label}_{k}": v for k, v in stats.items()})
        shown.append([label, stats["rows"], stats["kept"], stats["truncated"], stats["dropped"],
                      f"{stats['length_p50']}/{stats['length_p90']}/{stats['length_max']}"])
        if not stats["kept"]:
            raise FtcoreError(f"stage {ctx.stage}: every {label} row is longer than max_length={max_length}; "
                              "raise max_length")
        if ids is not None:
            out[label] = ids
    ctx.reporter.table(f"data for stage {ctx.stage} (tokens; data_report.json has more)",
                       ["split", "rows", "kept", "trunc.", "dropped", "length p50/p90/max"], shown)
    return out


def reference_model(ctx: Any) -> Any:
    """The reference policy for TRL: ``None`` for a peft model (TRL then copies the live adapter into
    a frozen second adapter, ``ref``: the policy as it was when this stage started, whether the
    adapter is fresh or continues an earlier stage's), else a frozen copy of the model."""
    from peft import PeftModel

    if isinstance(ctx.model, PeftModel):
        return None
    ref = strip_forward_patches(copy.deepcopy(ctx.model))
    ref.requires_grad_(False)
    return ref.eval()


def drop_reference(model: Any) -> Any:
    """After training: remove TRL's ``ref`` adapter (the runner saves every adapter the model has)
    and its patched forward."""
    from peft import PeftModel

    if isinstance(model, PeftModel) and "ref" in model.peft_config:
        model.delete_adapter("ref")
    return strip_forward_patches(model)


def labelled(data: Any) -> list[bool] | None:
    return list(data["label"]) if data is not None and "label" in data.column_names else None


# -- training against a reference (dpo, kto) ----------------------------------------------------


def train_against_reference(ctx: Any, o: Any, name: str, trainer_cls: type, config_cls: type,
                            config: dict[str, Any], accepts: tuple[str, ...],
                            check_reference: Any = None, images: bool = False) -> dict[str, Any]:
    """Render, report lengths, measure the held-out rows under the policy as the stage starts (which
    is the reference), train with TRL against that reference, measure again. ``check_reference``
    (trainer, eval ids, start log-probs) -> metrics, to compare TRL's reference with the start.
    ``images``: the trainer takes pairs with images (:func:`train_pairs_with_images`)."""
    from ftcore_plugins.common.vision import has_images
    from ftcore_plugins.trainers._training import run_trainer

    kind = require_data(ctx, name, accepts, images=images)
    if images and (has_images(ctx.train_data) or has_images(ctx.eval_data)):
        return train_pairs_with_images(ctx, o, name, trainer_cls, config_cls, config)
    train = render(ctx, ctx.train_data, strip_bos=True)
    evaluation = render(ctx, ctx.eval_data, strip_bos=True) if ctx.eval_data is not None else None
    ids = length_report(ctx, {"train": train, "eval": evaluation}, o.max_length, style="trl")
    if name == "kto" and kind == "pairs":
        train = unpair(train, ctx.seed)
    pad = ctx.tokenizer.pad_token_id if ctx.tokenizer.pad_token_id is not None else ctx.tokenizer.eos_token_id
    start = answer_logps(ctx.model, ids["eval"], o.max_length, pad, o.batch_size) if "eval" in ids else None
    trainer, metrics = run_trainer(ctx, o, trainer_cls, config_cls, train=train,
                                   evaluation=evaluation if periodic_evaluation(o) else None,
                                   config={"max_length": o.max_length, "beta": o.beta, "dataset_num_proc": None,
                                           "gradient_checkpointing": o.gradient_checkpointing, **config},
                                   ref_model=reference_model(ctx), strip_patches=False)
    metrics.update(getattr(trainer, "padding_free_counts", {}))  # padding_free = true: what it did
    if start is not None:
        if check_reference is not None:
            metrics.update(check_reference(trainer, ids["eval"], start))
        end = answer_logps(ctx.model, ids["eval"], o.max_length, pad, o.batch_size)
        labels = labelled(evaluation)
        if labels is not None:  # answer_logps leaves out the rows whose prompt fills max_length
            labels = [label for label, (p, _) in zip(labels, ids["eval"]) if len(p) < o.max_length]
        metrics.update(held_out(start, end, o.beta, labels))
        ctx.reporter.log(ctx.stage, {k: v for k, v in metrics.items() if k.startswith("eval_")},
                         step=metrics.get("global_step"))
    metrics.pop("eval_perplexity", None)  # exp of a preference loss is no perplexity
    ctx.model = drop_reference(ctx.model)
    return metrics


def train_pairs_with_images(ctx: Any, o: Any, name: str, trainer_cls: type, config_cls: type,
                            config: dict[str, Any]) -> dict[str, Any]:
    """:func:`train_against_reference` for preference pairs with images: the rows rendered to text with their
    image references, batched by TRL's vision collator (through :class:`VisionPairCollator`, which decodes the
    images), TRL's DPOTrainer given the processor; the held-out measurement from the same batches."""
    from ftcore_plugins.trainers._training import run_trainer
    from ftcore_plugins.common.vision import image_template
    from ftcore_plugins.trainers._vision import pair_logps, pair_reference_gap, pair_tokens, save_processor, \
        vision_pairs

    train, evaluation, collator = vision_pairs(ctx, o, name)
    splits = {"train": train, "eval": evaluation}
    template = image_template(ctx.template)
    length_report(ctx, splits, o.max_length, style="plain",
                  measured={k: pair_tokens(collator, template, v) for k, v in splits.items() if v is not None})
    start = pair_logps(ctx.model, collator, evaluation, o.batch_size) if evaluation is not None else None
    trainer, metrics = run_trainer(ctx, o, trainer_cls, config_cls, train=train,
                                   evaluation=evaluation if periodic_evaluation(o) else None,
                                   config={"max_length": o.max_length, "beta": o.beta, "dataset_num_proc": None,
                                           "gradient_checkpointing": o.gradient_checkpointing,
                                           "remove_unused_columns": False, **config},
                                   ref_model=reference_model(ctx), strip_patches=False, data_collator=collator,
                                   processing_class=collator.processor)
    if start is not None:
        metrics.update(pair_reference_gap(trainer, collator, evaluation, start))
        end = pair_logps(ctx.model, collator, evaluation, o.batch_size)
        metrics.update(held_out(start, end, o.beta, None))
        ctx.reporter.log(ctx.stage, {k: v for k, v in metrics.items() if k.startswith("eval_")},
                         step=metrics.get("global_step"))
    metrics.pop("eval_perplexity", None)
    ctx.model = drop_reference(ctx.model)
    save_processor(ctx, collator.processor)
    return metrics


def periodic_evaluation(o: Any) -> bool:
    """Whether TRL should also evaluate during training (for eval_steps, early stopping, best
    checkpoint). The before/after measurement is ours either way: TRL averages its evaluation's
    reward metrics per batch, which weighs a short last batch like a full one."""
    return bool(getattr(o, "eval_steps", None) or getattr(o, "early_stopping_patience", None)
                or getattr(o, "load_best_at_end", None))


def held_out(start: Any, end: Any, beta: float, labels: list[bool] | None) -> dict[str, float]:
    """The objective on held-out rows. Pairs: the policy's own preference (log-probability of the
    chosen answer minus the rejected one's) before and after, and the implicit reward
    beta * (log p - log p_ref) after (before training the policy is its reference: every reward 0).
    Unpaired rows: mean reward of desirable answers minus that of undesirable ones."""
    reward = beta * (end[..., 0] - start[..., 0])
    if labels is None:
        out = {"eval_pairs": int(start.shape[0])}
        out.update(pair_metrics("eval_logp_", start[:, 0, 0], start[:, 1, 0]))
        out = {f"{k}_before" if k != "eval_pairs" else k: v for k, v in out.items()}
        out.update(pair_metrics("eval_logp_", end[:, 0, 0], end[:, 1, 0]))
        out.update(pair_metrics("eval_reward_", reward[:, 0], reward[:, 1]))
        return out
    import torch

    good = torch.tensor(labels, dtype=torch.bool)
    desirable, undesirable = reward[good, 0].mean().item(), reward[~good, 0].mean().item()
    return {"eval_rows": int(reward.shape[0]), "eval_reward_desirable": desirable,
            "eval_reward_undesirable": undesirable, "eval_reward_margin": desirable - undesirable}
