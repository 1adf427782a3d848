"""Training on chat rows with images: the rows stay references until a batch is built, where
:class:`ftcore_plugins.common.vision.VisionCollator` decodes the images, renders, labels and processes them."""

from __future__ import annotations

from typing import Any

from ftcore.errors import FtcoreError

from ftcore_plugins.common.prepare import data_origin, is_stream
from ftcore_plugins.common.vision import VisionCollator, VisionEncoder, has_images, processor_of


def image_rows(ctx: Any) -> bool:
    """Whether the stage's train data holds rows with images."""
    return has_images(ctx.train_data)


def vision_splits(ctx: Any, o: Any, trainer: str) -> tuple[Any, Any, VisionCollator]:
    """The train and eval rows as they are (each with its index, for messages) and the collator that
    turns them into batches. Refuses, in one line, what this path does not do yet."""
    where = data_origin(ctx, "train")[0]
    processor = processor_of(ctx.tokenizer)
    if processor is None:
        raise FtcoreError(f"{where}: the rows hold images, but the model is a text model (its loader gave no "
                          "processor); load a vision-language model (docs/vision.md)")
    if getattr(o, "packing", False):
        raise FtcoreError(f"stage {ctx.stage}: packing = true is not supported for rows with images yet; set "
                          "packing = false")
    if getattr(o, "padding_free", False):
        raise FtcoreError(f"stage {ctx.stage}: padding_free = true is not supported for rows with images yet")
    out = []
    for label, rows in (("train", ctx.train_data), ("eval", ctx.eval_data)):
        if rows is not None and is_stream(rows):
            raise FtcoreError(f"{data_origin(ctx, label)[0]}: streaming rows with images is not supported yet; "
                              "set streaming = false")
        if rows is not None and "__index" not in rows.column_names:
            rows = rows.add_column("__index", list(range(len(rows))))
        out.append(rows)
    encoder = VisionEncoder(processor, ctx.template, max_length=o.max_length,
                            train_on_inputs=getattr(o, "train_on_inputs", False), where=where)
    ctx.reporter.info(f"stage [bold]{ctx.stage}[/]: {len(out[0]):,} rows with images; they are rendered, labelled and "
                      "their images decoded batch by batch")
    return out[0], out[1], VisionCollator(encoder)


def vision_trl(collator: VisionCollator) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(config, trainer kwargs)`` that make TRL's trainer take the rows as they are, through ``collator``."""
    return ({"remove_unused_columns": False, "dataset_kwargs": {"skip_prepare_dataset": True}},
            {"data_collator": collator, "processing_class": collator.encoder.processor})


def save_processor(ctx: Any, collator: VisionCollator) -> None:
    """The processor (image processor, chat template) in the stage's output, next to what the runner saves
    there (the adapter or model, the tokenizer), so the output loads as a vision-language model."""
    if getattr(getattr(ctx, "run", None), "is_main", True):
        ctx.output.mkdir(parents=True, exist_ok=True)
        collator.encoder.processor.save_pretrained(ctx.output)
