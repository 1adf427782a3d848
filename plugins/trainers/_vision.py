"""Training on chat rows with images: the rows stay references until a batch is built, where
:class:`ftcore_plugins.common.vision.VisionCollator` decodes the images, renders, labels and processes them."""

from __future__ import annotations

from typing import Any

from ftcore.errors import FtcoreError

from ftcore_plugins.common.images import ImageError, load_image
from ftcore_plugins.common.prepare import data_origin, is_stream
from ftcore_plugins.common.vision import (VisionCollator, VisionEncoder, has_images, image_template,
                                          require_processor, vision_token_ids)


def image_rows(ctx: Any) -> bool:
    """Whether the stage's train data holds rows with images."""
    return has_images(ctx.train_data)


def _checked(ctx: Any, o: Any) -> tuple[str, Any]:
    """How messages name the train rows, and the processor; refuses, in one line, what the image path
    does not do yet."""
    where = data_origin(ctx, "train")[0]
    processor = require_processor(ctx.tokenizer, where)
    if getattr(o, "packing", False):
        raise FtcoreError(f"stage {ctx.stage}: packing = true is not supported for rows with images yet; set "
                          "packing = false")
    if getattr(o, "padding_free", False):
        raise FtcoreError(f"stage {ctx.stage}: padding_free = true is not supported for rows with images yet")
    return where, processor


def _indexed(ctx: Any) -> list[Any]:
    """The train and eval rows, each with its index (for messages); a stream is refused in one line."""
    out = []
    for label, rows in (("train", ctx.train_data), ("eval", ctx.eval_data)):
        if rows is not None and is_stream(rows):
            raise FtcoreError(f"{data_origin(ctx, label)[0]}: streaming rows with images is not supported yet; "
                              "set streaming = false")
        if rows is not None and "__index" not in rows.column_names:
            rows = rows.add_column("__index", list(range(len(rows))))
        out.append(rows)
    return out


def vision_splits(ctx: Any, o: Any, trainer: str) -> tuple[Any, Any, VisionCollator]:
    """The train and eval rows as they are (each with its index, for messages) and the collator that
    turns them into batches. Refuses, in one line, what this path does not do yet."""
    where, processor = _checked(ctx, o)
    out = _indexed(ctx)
    encoder = VisionEncoder(processor, ctx.template, max_length=o.max_length,
                            train_on_inputs=getattr(o, "train_on_inputs", False), where=where)
    ctx.reporter.info(f"stage [bold]{ctx.stage}[/]: {len(out[0]):,} rows with images; they are rendered, labelled and "
                      "their images decoded batch by batch")
    return out[0], out[1], VisionCollator(encoder)


def vision_trl(collator: VisionCollator) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(config, trainer kwargs)`` that make TRL's trainer take the rows as they are, through ``collator``."""
    return ({"remove_unused_columns": False, "dataset_kwargs": {"skip_prepare_dataset": True}},
            {"data_collator": collator, "processing_class": collator.encoder.processor})


def save_processor(ctx: Any, processor: Any) -> None:
    """The processor (image processor, chat template) in the stage's output, next to what the runner saves
    there (the adapter or model, the tokenizer), so the output loads as a vision-language model."""
    if getattr(getattr(ctx, "run", None), "is_main", True):
        ctx.output.mkdir(parents=True, exist_ok=True)
        processor.save_pretrained(ctx.output)


# -- preference pairs with images (dpo) --------------------------------------------------------------

# Model types whose processor returns a cross-attention mask over the text: TRL's DPO collator builds it for
# the prompt alone, so the answers' tokens have none (Llama 3.2 Vision fails in its attention).
CROSS_ATTENTION = ("mllama",)
# Per-token tensors of TRL's DPO batch, cut with input_ids at max_length (as its collator cuts them).
PAIR_PER_TOKEN = ("input_ids", "attention_mask", "completion_mask", "token_type_ids", "mm_token_type_ids")


class VisionPairCollator:
    """Preference pairs with images -> TRL's DPO batch. The rows are text already (the prompt rendered by the
    plan's template, each ``<image>`` as the family's image token, and each answer as the text that continues
    it, its end of turn included, as for text pairs); their images are decoded here, one batch at a time, and
    TRL's own ``DataCollatorForVisionPreference`` processes them (the images expanded in the prompts). Then
    an answer that holds an image token, or a prompt that fills ``max_length`` (no answer token left), is
    refused in one line, and the batch is cut at ``max_length`` as TRL cuts it: the images sit in the prompt,
    so the cut takes answer tokens only."""

    def __init__(self, processor: Any, *, max_length: int | None, where: str):
        from trl.trainer.dpo_trainer import DataCollatorForVisionPreference

        self.processor, self.max_length, self.where = processor, max_length, where
        self.trl = DataCollatorForVisionPreference(processor=processor, max_length=None)
        self.tokenizer = processor.tokenizer
        self.never = vision_token_ids(self.tokenizer)
        self.never_text = self.tokenizer.convert_ids_to_tokens(sorted(self.never))

    def _refuse_image_token(self, index: int, side: str, token: str) -> None:
        raise FtcoreError(f"{self.where}, row {index + 1}: the {side} answer holds the image token {token!r}; a "
                          "pair's images go in its prompt")

    def __call__(self, examples: list[dict]) -> dict[str, Any]:
        indices = [e.get("__index", k) for k, e in enumerate(examples)]
        rows = []
        for e, index in zip(examples, indices):
            for side in ("chosen", "rejected"):
                token = next((t for t in self.never_text if t in e[side]), None)
                if token is not None:
                    self._refuse_image_token(index, side, token)
            try:
                images = [load_image(r) for r in e.get("images") or []]
            except ImageError as exc:
                raise FtcoreError(f"{self.where}, row {index + 1}: {exc}") from None
            rows.append({"prompt": e["prompt"], "chosen": e["chosen"], "rejected": e["rejected"], "images": images})
        batch = self.trl(rows)
        ids, answer = batch["input_ids"], batch["completion_mask"].bool()
        n = len(rows)
        for k in range(ids.shape[0]):
            index, side = indices[k % n], ("chosen", "rejected")[k // n]
            tokens = ids[k][answer[k]].tolist()
            if any(t in self.never for t in tokens):
                self._refuse_image_token(index, side, self.tokenizer.convert_ids_to_tokens(
                    next(t for t in tokens if t in self.never)))
            prompt = int(batch["attention_mask"][k].sum() - answer[k].sum())
            if self.max_length is not None and prompt >= self.max_length:
                raise FtcoreError(f"{self.where}, row {index + 1}: its prompt is {prompt} tokens with its images, and "
                                  f"max_length = {self.max_length} leaves no token of its answers; raise max_length")
        if self.max_length is not None and ids.shape[1] > self.max_length:
            for key in PAIR_PER_TOKEN:
                if key in batch:
                    batch[key] = batch[key][:, :self.max_length]
        return batch


def vision_pairs(ctx: Any, o: Any, trainer: str) -> tuple[Any, Any, VisionPairCollator]:
    """Preference pairs with images for TRL's DPOTrainer: the train and eval rows rendered to text (each
    with its index and its image references) and the collator that decodes and processes a batch of them."""
    from ftcore_plugins.common.preference import render

    where, processor = _checked(ctx, o)
    model_type = getattr(getattr(ctx.model, "config", None), "model_type", None)
    if model_type in CROSS_ATTENTION:
        raise FtcoreError(f"stage {ctx.stage}: trainer '{trainer}' does not train a {model_type} model on rows with "
                          "images: TRL's DPO batches give its cross-attention mask to the prompt only; sft does "
                          "(docs/vision.md)")
    template = image_template(ctx.template)
    train, evaluation = _indexed(ctx)
    # TRL tells a vision dataset by the `images` of the train rows; rows without any get an empty list.
    feature = (train if has_images(train) else evaluation).features["images"]
    train, evaluation = [rows if rows is None or has_images(rows) else
                         rows.add_column("images", [[] for _ in range(len(rows))], feature=feature)
                         for rows in (train, evaluation)]
    keep = ("images", "__index")
    # The template writes the BOS; TRL's collator adds no special tokens.
    train = render(ctx, train, strip_bos=False, template=template, keep=keep)
    if evaluation is not None:
        evaluation = render(ctx, evaluation, strip_bos=False, template=template, keep=keep)
    ctx.reporter.info(f"stage [bold]{ctx.stage}[/]: {len(train):,} pairs with images; their images are decoded and "
                      "processed batch by batch")
    return train, evaluation, VisionPairCollator(processor, max_length=o.max_length, where=where)


def pair_logps(model: Any, collator: VisionPairCollator, rows: Any, batch_size: int) -> Any:
    """Summed log-probability and token count of each pair's chosen and rejected answers given the prompt
    and its images, from the batches ``collator`` builds, as TRL scores them. A tensor (rows, 2, 2)."""
    import torch

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out = []
    try:
        with torch.no_grad():
            for start in range(0, len(rows), batch_size):
                batch = collator([rows[i] for i in range(start, min(start + batch_size, len(rows)))])
                batch = {k: v.to(device) for k, v in batch.items()}
                mask = batch.pop("completion_mask")[:, 1:]
                logits = model(**batch, use_cache=False).logits[:, -mask.shape[1] - 1:-1]
                logps = torch.log_softmax(logits.float(), -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
                sums, counts = (logps * mask).sum(-1).cpu(), mask.sum(-1).float().cpu()
                n = sums.shape[0] // 2
                out.append(torch.stack([torch.stack([sums[:n], counts[:n]], -1),
                                        torch.stack([sums[n:], counts[n:]], -1)], 1))
    finally:
        model.train(was_training)
    return torch.cat(out)


def pair_reference_gap(trainer: Any, collator: VisionPairCollator, rows: Any, start: Any) -> dict[str, float]:
    """For pairs with images: the largest difference between the log-probabilities TRL's reference gives the
    held-out answers and the policy's when the stage started (``start``, from :func:`pair_logps`)."""
    import torch

    size = trainer.args.per_device_eval_batch_size
    found = []
    for begin in range(0, len(rows), size):
        batch = collator([rows[i] for i in range(begin, min(begin + size, len(rows)))])
        batch = {k: v.to(trainer.accelerator.device) for k, v in batch.items()}
        # As TRL's own precompute calls it: the reference model, or the peft model (its `ref` adapter).
        chosen, rejected = trainer.compute_ref_log_probs(trainer.ref_model or trainer.model, batch)
        found.append(torch.stack([chosen, rejected], -1).float().cpu())
    return {"reference_logp_max_diff": (torch.cat(found) - start[..., 0]).abs().max().item()}
