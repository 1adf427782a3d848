"""Training on chat rows with images: the rows stay references until a batch is built, where
:class:`ftcore_plugins.common.vision.VisionCollator` decodes the images, renders, labels and processes them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ftcore.errors import FtcoreError

from ftcore_plugins.common.chat import IGNORE
from ftcore_plugins.common.images import IMAGE, ImageError, image_size, load_image
from ftcore_plugins.common.prepare import data_origin, is_stream, padding_fraction
from ftcore_plugins.common.vision import (VisionCollator, VisionEncoder, has_images, image_template,
                                          require_processor, vision_token_ids)


def image_rows(ctx: Any) -> bool:
    """Whether the stage's train data holds rows with images."""
    return has_images(ctx.train_data)


# Families whose image rows pack: a packed batch's loss equals the unpacked batch's (tests/test_vision_packing.py).
PACKS = ("llava", "idefics3", "qwen2_5_vl", "qwen3_vl")
# Families whose attention packing would change, and why.
PACKING_CHANGES = {"gemma3": "its image tokens attend to each other both ways, which packed attention does not keep",
                   "mllama": "its cross-attention mask is built per row, not per packed sample"}


def _checked(ctx: Any, o: Any) -> tuple[str, Any]:
    """How messages name the train rows, and the processor; refuses, in one line, what the image path
    does not do yet."""
    where = data_origin(ctx, "train")[0]
    processor = require_processor(ctx.tokenizer, where)
    model_type = getattr(getattr(getattr(ctx, "model", None), "config", None), "model_type", None)
    if getattr(o, "packing", False) and model_type not in PACKS:
        why = PACKING_CHANGES.get(model_type, f"packing is verified on {', '.join(PACKS)} only")
        raise FtcoreError(f"stage {ctx.stage}: packing = true does not pack {model_type} rows with images: {why}; set "
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
    """The train and eval rows as they are (each with its index, for messages), or with ``packing`` the
    train rows' bins, and the collator that turns them into batches; their data report, as the text path
    gives it. Refuses, in one line, what this path does not do yet."""
    where, processor = _checked(ctx, o)
    train, evaluation = _indexed(ctx)
    encoder = VisionEncoder(processor, ctx.template, max_length=o.max_length,
                            train_on_inputs=getattr(o, "train_on_inputs", False), where=where)
    if getattr(o, "packing", False) and o.max_length is None:
        raise FtcoreError(f"stage {ctx.stage}: packing = true needs max_length (the length of a packed row)")
    measured = {"train": row_tokens(encoder, train)}
    if evaluation is not None:
        measured["eval"] = row_tokens(encoder, evaluation)
    bins = best_fit([r.length for r in measured["train"]], o.max_length) if getattr(o, "packing", False) else None
    report_image_rows(ctx, measured, o, bins)
    if bins is not None:
        ctx.reporter.info(f"stage [bold]{ctx.stage}[/]: {len(train):,} rows with images in {len(bins):,} packed rows "
                          f"of {o.max_length} tokens; they are rendered, labelled and their images decoded batch by batch")
        from datasets import Dataset

        return Dataset.from_dict({BIN: bins}), evaluation, PackedImageRows(encoder, train, rope_index(ctx.model))
    ctx.reporter.info(f"stage [bold]{ctx.stage}[/]: {len(train):,} rows with images; they are rendered, labelled and "
                      "their images decoded batch by batch")
    return train, evaluation, VisionCollator(encoder)


# -- what the rows hold (the data report) -----------------------------------------------------------

@dataclass(frozen=True)
class RowTokens:
    """A row with images as its batch holds it."""

    length: int  # tokens, its images expanded, before max_length cuts any
    trained: int  # tokens trained, once max_length has cut the row's end
    images: int


class ImageTokens:
    """What the processor adds to a rendered row for an image of a given size: measured once a size, on a
    blank image of that size in a user turn of its own as ``template`` renders it (so the family's own image
    markup, whatever token the processor expands), never on a decoded image."""

    def __init__(self, processor: Any, template: Any, tokenizer: Any):
        self.processor = processor
        self.probe = template.render([{"role": "user", "content": IMAGE}], tokenizer)
        self.alone = len(tokenizer(self.probe, add_special_tokens=False)["input_ids"])
        self.added: dict[tuple[int, int], int] = {}

    def __call__(self, size: tuple[int, int]) -> int:
        if size not in self.added:
            from PIL import Image

            blank = self.processor(text=[self.probe], images=[[Image.new("RGB", size)]], add_special_tokens=False)
            self.added[size] = len(blank["input_ids"][0]) - self.alone
        return self.added[size]


# Rows measured in this process, by what decides the measure: a run measures a stage's rows before the model
# loads (ftcore_prepare_data) and again when the stage starts; the second time costs nothing. The last few.
_MEASURED: dict[str, list[RowTokens]] = {}


def _measure_key(encoder: VisionEncoder, rows: Any) -> str | None:
    import hashlib
    import json

    from ftcore_plugins.common.prepare import data_fingerprint, template_fingerprint, tokenizer_fingerprint

    if not hasattr(rows, "with_format"):  # not a Dataset: measured every time
        return None
    return hashlib.sha256(json.dumps([data_fingerprint(rows), tokenizer_fingerprint(encoder.tokenizer),
                                      template_fingerprint(encoder.template, encoder.tokenizer), encoder.max_length,
                                      encoder.train_on_inputs]).encode()).hexdigest()


def row_tokens(encoder: VisionEncoder, rows: Any) -> list[RowTokens]:
    """Each row's tokens with its images expanded and those it trains, without decoding an image: its
    rendered text's tokens and labels, plus what the processor adds for an image of each size (each
    image's size comes from its file's header). The processor's own on every family but Gemma 3, whose
    processor writes newlines around each image that can merge with the text beside it (a token or two
    off, per image)."""
    key = _measure_key(encoder, rows)
    if key in _MEASURED:
        return _MEASURED[key]
    added = ImageTokens(encoder.processor, encoder.template, encoder.tokenizer)
    cut = encoder.max_length
    out = []
    for k, row in enumerate(rows):
        try:
            ids, labels = encoder.text_and_labels(row)[1:]
            sizes = [image_size(ref) for ref in row.get("images") or []]
        except (FtcoreError, ImageError) as exc:
            raise FtcoreError(f"{encoder.where}, row {row.get('__index', k) + 1}: {exc}") from None
        extra = sum(added(size) for size in sizes)
        # A trained token after every image moves on by all their tokens (i + extra). One before an image moves
        # on by fewer, but is inside max_length whenever that image is, and so is i + extra: max_length never
        # cuts an image (such a row is refused).
        trained = sum(1 for i, (t, label) in enumerate(zip(ids, labels)) if label != IGNORE and t not in encoder.never
                      and (cut is None or i + extra < cut))
        out.append(RowTokens(len(ids) + extra, trained, len(sizes)))
    if key is not None:
        while len(_MEASURED) >= 4:
            _MEASURED.pop(next(iter(_MEASURED)))
        _MEASURED[key] = out
    return out


def expanded_lengths(encoder: VisionEncoder, rows: Any) -> list[int]:
    """Each row's length in tokens with its images expanded, without decoding an image (:func:`row_tokens`)."""
    return [r.length for r in row_tokens(encoder, rows)]


def report_image_rows(ctx: Any, measured: dict[str, list[RowTokens]], o: Any, bins: list[list[int]] | None) -> None:
    """The stage's data report for rows with images, as the text path gives it (``data_report.json``,
    ``metrics.jsonl``, the console's table): per split the rows, their images, the rows max_length cuts,
    the tokens (images expanded) and those trained, the length percentiles; for the train rows the padding
    batches carry and, with packing (``bins``), how full the packed rows are."""
    import random

    shown = []
    for label, rows in measured.items():
        lengths = [min(r.length, o.max_length or r.length) for r in rows]  # as max_length leaves them
        ordered = sorted(lengths)
        stats: dict[str, Any] = {
            "rows": len(rows), "images": sum(r.images for r in rows), "kept": len(rows),
            "truncated": sum(o.max_length is not None and r.length > o.max_length for r in rows),
            "tokens": sum(lengths), "label_tokens": sum(r.trained for r in rows)}
        if ordered:
            for p in (50, 90, 99):
                stats[f"length_p{p}"] = ordered[min(len(ordered) - 1, (p * len(ordered)) // 100)]
            stats["length_max"] = ordered[-1]
        if label == "train" and lengths:
            shuffled = random.Random(0).sample(lengths, len(lengths))  # batches are drawn in random order
            stats["padding_fraction_unpacked"] = padding_fraction(shuffled, o.batch_size)
            if bins is not None:
                filled = sum(lengths) / (len(bins) * o.max_length) if bins else 0.0
                stats.update(packed_sequences=len(bins), packing_efficiency=filled, padding_fraction_packed=1 - filled)
        ctx.reporter.data_report(f"{ctx.stage}/{label}", stats)
        ctx.reporter.log(ctx.stage, {f"data/{label}_{k}": v for k, v in stats.items()})
        shown.append([label, stats["rows"], stats["images"], stats["kept"], stats["truncated"], stats["tokens"],
                      stats["label_tokens"], f"{stats.get('length_p50', 0)}/{stats.get('length_p90', 0)}/"
                      f"{stats.get('length_max', 0)}"])
    more = "; data_report.json has more" if ctx.reporter.metrics_path else ""
    ctx.reporter.table(f"data for stage {ctx.stage} (images expanded{more})",
                       ["split", "rows", "images", "kept", "trunc.", "tokens", "trained", "length"], shown)


# -- packing (sft) -----------------------------------------------------------------------------------

BIN = "__bin"  # the column of a packed train set: each row the indices of the image rows one packed row holds


def best_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing, as TRL's ``bfd`` packs tokenized rows: the indices of ``lengths`` in bins
    whose lengths sum to at most ``capacity``, longest first; a longer one gets a bin of its own."""
    import bisect

    bins: list[list[int]] = []
    space: list[tuple[int, int]] = []  # (room left, bin), sorted: the tightest bin that fits is a bisect away
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        k = bisect.bisect_left(space, (lengths[i], -1))
        room, b = space.pop(k) if k < len(space) else (capacity, len(bins))
        if b == len(bins):
            bins.append([])
        bins[b].append(i)
        if room - lengths[i] > 0:
            bisect.insort(space, (room - lengths[i], b))
    return bins


def rope_index(model: Any) -> Any:
    """The model's ``get_rope_index`` where its positions are 3-D (Qwen-VL's rope over time, height and
    width, computed from the image grids), else None."""
    return next((m.get_rope_index for m in model.modules() if callable(getattr(m, "get_rope_index", None))), None)


class PackedImageRows(VisionCollator):
    """``packing = true`` on rows with images: a batch of bins (each a list of indices of ``rows``) -> the
    samples concatenated, one row per bin (``binned``: the binned attention paths) or one row for the
    whole batch (the other paths), as the text path's collators make them: position ids restarting at
    each sample, no attention mask, the first token of each sample not predicted from the one before,
    padding at a row's end never trained. The pixels and image grids stay in sample order, which is the
    order of the image tokens in the packed rows. Where positions are 3-D (``rope``: Qwen-VL), each
    sample's come from the model's own ``get_rope_index``, under the text positions transformers reads to
    find the samples. Eval rows (no bins) are each their own sample."""

    def __init__(self, encoder: VisionEncoder, rows: Any, rope: Any = None):
        super().__init__(encoder)
        self.rows, self.rope = rows, rope
        self.binned = False  # set from the stage's packed-attention path
        self.width: int | None = None  # binned rows padded to this many positions (flex), else to the longest

    def __call__(self, examples: list[dict]) -> dict[str, Any]:
        import torch

        from ftcore_plugins.trainers._packing import BinnedBatches

        groups = [[self.rows[i] for i in e[BIN]] for e in examples] if BIN in examples[0] else [[e] for e in examples]
        if not self.binned:
            groups = [[row for group in groups for row in group]]
        flat = [row for group in groups for row in group]
        batch = super().__call__(flat)
        lengths = batch.pop("attention_mask").sum(1).tolist()
        per_token = [k for k in ("input_ids", "labels", "mm_token_type_ids", "token_type_ids") if k in batch]
        width = max(self.width or 0, *(sum(lengths[k] for k in range(start, start + len(g)))
                                       for start, g in _starts(groups)))
        fill = {"input_ids": self.encoder.tokenizer.pad_token_id or 0, "labels": IGNORE}
        out = {k: torch.full((len(groups), width), fill.get(k, 0), dtype=batch[k].dtype) for k in per_token}
        text = torch.zeros((len(groups), width), dtype=torch.long)
        rope = torch.zeros((3, len(groups), width), dtype=torch.long) if self.rope else None
        grids = batch.get("image_grid_thw")
        image = 0
        for g, (first, group) in enumerate(_starts(groups)):
            at = 0
            for k in range(first, first + len(group)):
                n = lengths[k]
                for key in per_token:
                    out[key][g, at:at + n] = batch[key][k, :n]
                out["labels"][g, at] = IGNORE
                text[g, at:at + n] = torch.arange(n)
                if rope is not None:
                    count = len(flat[k].get("images") or [])
                    rope[:, g, at:at + n] = self.rope(
                        input_ids=batch["input_ids"][k:k + 1, :n],
                        mm_token_type_ids=batch["mm_token_type_ids"][k:k + 1, :n],
                        image_grid_thw=grids[image:image + count] if count else None,
                        attention_mask=torch.ones((1, n), dtype=torch.long))[0][:, 0]
                    image += count
                at += n
            # The padding continues the last sample: it sees that sample, which never sees it (causal).
            text[g, at:] = torch.arange(n, n + width - at)
            if rope is not None:
                rope[:, g, at:] = rope[:, g, at - 1:at].max() + 1 + torch.arange(width - at)
        batch.update(out)
        batch["position_ids"] = text if rope is None else torch.cat([text[None], rope])
        batch[BinnedBatches.REAL_TOKENS] = sum(lengths)
        return batch


def _starts(groups: list[list]) -> list[tuple[int, list]]:
    """Each group with the index of its first row in the flattened batch."""
    out, first = [], 0
    for group in groups:
        out.append((first, group))
        first += len(group)
    return out


def vision_trl(collator: VisionCollator) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(config, trainer kwargs)`` that make TRL's trainer take the rows as they are, through ``collator``."""
    # TRL neither prepares nor packs the rows: the collator renders and (with packing) packs them.
    return ({"remove_unused_columns": False, "dataset_kwargs": {"skip_prepare_dataset": True}, "packing": False},
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


def pair_tokens(collator: VisionPairCollator, template: Any, rows: Any) -> list[tuple[int, int]]:
    """Each rendered pair's prompt tokens, its images expanded (:class:`ImageTokens`, no image decoded), and
    its longer answer's tokens: what ``collator`` makes of it, for the length report."""
    tokenizer = collator.tokenizer
    added = ImageTokens(collator.processor, template, tokenizer)

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    out = []
    for k, row in enumerate(rows):
        try:
            extra = sum(added(image_size(ref)) for ref in row.get("images") or [])
        except ImageError as exc:
            raise FtcoreError(f"{collator.where}, row {row.get('__index', k) + 1}: {exc}") from None
        out.append((count(row["prompt"]) + extra, max(count(row["chosen"]), count(row["rejected"]))))
    return out


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
