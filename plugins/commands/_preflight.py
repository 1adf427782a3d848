"""What ``ftcore check`` and ``ftcore lr-find`` share: a stage's supervised rows, and batches of them."""

from __future__ import annotations

from typing import Any

from ftcore.errors import FtcoreError


class ImageRows:
    """A stage's rows with images as ``check`` and ``lr-find`` read them: each row rendered, labelled and
    its images processed by the run's own encoder when it is read, a batch at a time with :meth:`batch`."""

    def __init__(self, rows: Any, encoder: Any):
        self.rows, self.encoder = rows, encoder
        self.image_ids = encoder.never  # the image and vision-placeholder tokens

    def __len__(self) -> int:
        return len(self.rows)

    def batch(self, indices: Any) -> dict[str, Any]:
        indices = list(indices)
        return self.encoder([self._row(i) for i in indices], indices)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        batch = self.batch([i])
        n = int(batch["attention_mask"][0].sum())
        return {"input_ids": batch["input_ids"][0, :n].tolist(), "labels": batch["labels"][0, :n].tolist()}

    def _row(self, i: int) -> dict:
        return {k: v for k, v in self.rows[i].items() if k != "__index"}


def supervised_rows(runner: Any, stage: Any, model: Any, tokenizer: Any) -> Any:
    """The stage's training rows as ``input_ids``/``labels`` (the trainer's own preparation where it has
    one; a preference stage's chosen answers), or None for a trainer that generates its answers."""
    from ftcore.runner import calling

    from ftcore_plugins.common.chat import chosen_as_chat
    from ftcore_plugins.common.prepare import data_origin, prepare
    from ftcore_plugins.common.vision import VisionEncoder, has_images, require_processor

    from ftcore_plugins.common.run_data import data_context

    ctx = data_context(runner, stage, model, tokenizer)
    trainer = stage.trainer.create()
    if hasattr(trainer, "prepare_data"):
        with calling(stage.trainer, "prepare_data"):
            train, _ = trainer.prepare_data(ctx)
        if has_images(train):  # rows with images stay rows until a batch is built: build them as the run does
            options = stage.trainer.options
            where = data_origin(ctx, "train")[0]
            encoder = VisionEncoder(require_processor(tokenizer, where), runner.template,
                                    max_length=getattr(options, "max_length", None),
                                    train_on_inputs=getattr(options, "train_on_inputs", False), where=where)
            return ImageRows(train, encoder)
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
    """Rows ``indices`` padded on the right into one batch (rows with images: the run's batch, pixels and all)."""
    import torch

    if isinstance(rows, ImageRows):
        return rows.batch(indices)

    ids = [rows[i]["input_ids"] for i in indices]
    labels = [rows[i]["labels"] for i in indices]
    width, pad = max(map(len, ids)), tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    # An encoder-decoder's labels (the answer) are a sequence of their own: padded to their own width.
    answers = max(map(len, labels))
    return {"input_ids": torch.tensor([r + [pad] * (width - len(r)) for r in ids]),
            "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in ids]),
            "labels": torch.tensor([r + [-100] * (answers - len(r)) for r in labels])}
