"""What ``ftcore check`` and ``ftcore lr-find`` share: a stage's supervised rows, and batches of them."""

from __future__ import annotations

from typing import Any

from ftcore.errors import FtcoreError


def supervised_rows(runner: Any, stage: Any, model: Any, tokenizer: Any) -> Any:
    """The stage's training rows as ``input_ids``/``labels`` (the trainer's own preparation where it has
    one; a preference stage's chosen answers), or None for a trainer that generates its answers."""
    from ftcore.runner import calling

    from ftcore_plugins.common.chat import chosen_as_chat
    from ftcore_plugins.common.prepare import data_origin, prepare

    from ftcore_plugins.common.run_data import data_context

    ctx = data_context(runner, stage, model, tokenizer)
    trainer = stage.trainer.create()
    if hasattr(trainer, "prepare_data"):
        with calling(stage.trainer, "prepare_data"):
            train, _ = trainer.prepare_data(ctx)
        return train
    rows = chosen_as_chat(ctx.train_data)
    columns = set(rows.column_names)
    if "messages" not in columns and not {"prompt", "completion"} <= columns:
        return None  # prompts alone (grpo, ppo, rloo)
    where, on_error = data_origin(ctx, "train")
    prepared = prepare(rows, tokenizer, runner.template, max_length=getattr(stage.trainer.options, "max_length", None),
                       on_error=on_error, where=where)
    if not prepared.stats["kept"]:
        raise FtcoreError(f"{where}: no chosen answer of stage {stage.name} is left with a token to learn")
    return prepared.dataset


def collate(rows: Any, indices: Any, tokenizer: Any) -> dict[str, Any]:
    """Rows ``indices`` padded on the right into one batch."""
    import torch

    ids = [rows[i]["input_ids"] for i in indices]
    labels = [rows[i]["labels"] for i in indices]
    width, pad = max(map(len, ids)), tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return {"input_ids": torch.tensor([r + [pad] * (width - len(r)) for r in ids]),
            "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in ids]),
            "labels": torch.tensor([r + [-100] * (width - len(r)) for r in labels])}
