"""Chat rows with images -> model inputs and assistant-only labels, through the model's processor.

The text path's method, unchanged, finds what to train (:mod:`ftcore_plugins.common.spans`): the
conversation is rendered by the plan's template (``native``: the processor's chat template, which
the loader gives the tokenizer; or a ``jinja`` file), with each :data:`~ftcore_plugins.common.images.IMAGE`
placeholder turned into an image content part, so the template writes the family's image token
(``<|vision_start|><|image_pad|><|vision_end|>``, ``<|image|>``, ``<start_of_image>``, ``<image>``).
That text is tokenized and labelled as a text row is. Then the processor, given the same text and
the decoded images, expands each image token into the image's tokens; the labels follow the
expansion by aligning the two token sequences, and whatever the expansion adds is never trained,
nor is any image or vision-placeholder token (:func:`vision_token_ids`).

This happens when a batch is built (:class:`VisionCollator`): images are decoded there, one batch
at a time, and a prepared corpus holds only the references.
"""

from __future__ import annotations

import difflib
from typing import Any

from ftcore.errors import FtcoreError

from ftcore_plugins.common.chat import IGNORE, _Offsets, label_spans, row_samples, samples_mode
from ftcore_plugins.common.images import IMAGE, ImageError, load_image
from ftcore_plugins.common.spans import SpanLocator, template_title

# Per-token tensors processors return besides input_ids (cut with it at max_length).
PER_TOKEN = ("attention_mask", "mm_token_type_ids", "token_type_ids", "cross_attention_mask")
# Tokens that stand for or frame an image in the families ftcore knows; any the tokenizer has are never trained.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<|vision_pad|>", "<|image|>",
                 "<start_of_image>", "<end_of_image>", "<image_soft_token>", "<image>", "<fake_token_around_image>",
                 "<global-img>", "<|image_start|>", "<|image_end|>", "<|image_token|>")


IMAGE_TEMPLATES = ("native", "jinja")  # templates that render image content parts (the model's own, a file)


def as_parts(messages: list[dict]) -> list[dict]:
    """Messages whose text holds image placeholders -> content parts, as VLM chat templates read them:
    ``"<image>What is it?"`` -> ``[{"type": "image"}, {"type": "text", "text": "What is it?"}]``. Every
    message gets parts (templates such as SmolVLM's read ``content[0]`` of any role)."""
    out = []
    for m in messages:
        content = m.get("content")
        if not isinstance(content, str):
            out.append(m)
            continue
        parts: list[dict] = []
        for i, text in enumerate(content.split(IMAGE)):
            if i:
                parts.append({"type": "image"})
            if text:
                parts.append({"type": "text", "text": text})
        out.append({**m, "content": parts or [{"type": "text", "text": ""}]})
    return out


class VisionTemplate:
    """The plan's chat template, rendering messages with image placeholders as content parts; every
    other attribute (name, options, stop tokens) is the template's."""

    def __init__(self, template: Any):
        self.template = template
        self.title = template_title(template)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.template, name)

    def render(self, messages: list[dict], tokenizer: Any = None, add_generation_prompt: bool = False,
               tools: list | None = None) -> str:
        extra = {"tools": tools} if tools else {}
        return self.template.render(as_parts(list(messages)), tokenizer, add_generation_prompt=add_generation_prompt,
                                    **extra)


def image_template(template: Any) -> VisionTemplate:
    """The plan's template, rendering image placeholders as image parts; a one-line error for a template
    that renders text only (a named built-in one)."""
    if getattr(template, "name", None) not in IMAGE_TEMPLATES:
        raise FtcoreError(f"{template_title(template)} renders text only, and these rows hold images; use "
                          "[template] use = \"native\" (the processor's chat template) or a \"jinja\" file that "
                          "renders image parts")
    return VisionTemplate(template)


def vision_token_ids(tokenizer: Any) -> set[int]:
    """The ids of every image or vision-placeholder token the tokenizer has."""
    vocab = tokenizer.get_vocab()
    ids = {vocab[t] for t in VISION_TOKENS if t in vocab}
    for name in ("image_token", "boi_token", "eoi_token"):
        token = getattr(tokenizer, name, None)
        if isinstance(token, str) and token in vocab:
            ids.add(vocab[token])
    return ids


def expand_labels(ids: list[int], labels: list[int], expanded: list[int], never: set[int]) -> list[int]:
    """``labels`` of ``ids`` carried over to ``expanded`` (the same text with each image token expanded
    by the processor): tokens the two share keep their labels, tokens the expansion adds or changes
    get none, and no token in ``never`` is trained. A trained token the expansion changes is an error."""
    out = [IGNORE] * len(expanded)
    matcher = difflib.SequenceMatcher(None, ids, expanded, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            out[j1:j2] = labels[i1:i2]
        elif any(label != IGNORE for label in labels[i1:i2]):
            raise FtcoreError("the processor changes tokens of a trained turn when it expands the images (an image "
                              "placeholder in an assistant turn?)")
    return [IGNORE if t in never else label for t, label in zip(expanded, out)]


class VisionEncoder:
    """Renders, labels and processes chat rows with images for one processor and template."""

    def __init__(self, processor: Any, template: Any, *, max_length: int | None = None,
                 train_on_inputs: bool = False, where: str = "data"):
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.template = image_template(template)
        if samples_mode(template) == "per_turn":
            raise FtcoreError(f"{self.template.title}: samples = \"per_turn\" is not supported for rows with images "
                              "yet; use the default (one sample per conversation)")
        self.locator = SpanLocator(self.template, self.tokenizer)
        self.max_length, self.train_on_inputs, self.where = max_length, train_on_inputs, where
        self.never = vision_token_ids(self.tokenizer)

    def text_and_labels(self, row: dict) -> tuple[str, list[int], list[int]]:
        """The rendered conversation (image tokens not yet expanded), its token ids and labels."""
        (text, spans), = row_samples(row, self.tokenizer, self.template, train_on_inputs=self.train_on_inputs,
                                     locator=self.locator)
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            backend.no_padding()
            backend.no_truncation()
            enc = backend.encode(text, add_special_tokens=False)
            ids, lookup = list(enc.ids), _Offsets(encoding=enc)
        else:
            enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            ids, lookup = enc["input_ids"], _Offsets(offsets=enc["offset_mapping"])
        labels = list(ids) if spans is None else label_spans(ids, spans, lookup)
        return text, ids, labels

    def __call__(self, rows: list[dict], indices: list[int] | None = None) -> dict[str, Any]:
        """A padded batch: the processor's tensors (pixels and all) and ``labels``."""
        import torch

        indices = indices if indices is not None else list(range(len(rows)))
        texts, encoded, images = [], [], []
        for row, index in zip(rows, indices):
            try:
                text, ids, labels = self.text_and_labels(row)
                refs = list(row.get("images") or [])
                images.append([load_image(r) for r in refs])
            except (FtcoreError, ImageError) as exc:
                raise FtcoreError(f"{self.where}, row {index + 1}: {exc}") from None
            texts.append(text)
            encoded.append((ids, labels))
        tokenizer = self.tokenizer
        side = tokenizer.padding_side
        tokenizer.padding_side = "right"
        try:
            kwargs = {"images": images} if any(images) else {}
            batch = self.processor(text=texts, add_special_tokens=False, padding=True, return_tensors="pt", **kwargs)
        finally:
            tokenizer.padding_side = side
        length = batch["input_ids"].shape[1]
        all_labels = []
        for k, ((ids, labels), index) in enumerate(zip(encoded, indices)):
            n = int(batch["attention_mask"][k].sum())
            expanded = batch["input_ids"][k, :n].tolist()
            try:
                row_labels = expand_labels(ids, labels, expanded, self.never)
            except FtcoreError as exc:
                raise FtcoreError(f"{self.where}, row {index + 1}: {exc}") from None
            all_labels.append(row_labels + [IGNORE] * (length - n))
        batch["labels"] = torch.tensor(all_labels, dtype=torch.long)
        if self.max_length is not None and length > self.max_length:
            self._cut(batch, indices)
        return dict(batch)

    def _cut(self, batch: Any, indices: list[int]) -> None:
        """Rows longer than ``max_length`` lose their end (their response), never an image's tokens."""
        n = self.max_length
        ids = batch["input_ids"]
        for k, index in enumerate(indices):
            tail = ids[k, n:].tolist()
            if any(t in self.never for t in tail):
                raise FtcoreError(f"{self.where}, row {index + 1}: {int(batch['attention_mask'][k].sum())} tokens with "
                                  f"its images, and max_length = {n} would cut into an image; raise max_length")
        for key in ("input_ids", "labels", *PER_TOKEN):
            if key in batch and batch[key].dim() >= 2 and batch[key].shape[1] == ids.shape[1]:
                batch[key] = batch[key][:, :n]


class VisionCollator:
    """A data collator for trainers: dataset rows (``messages``, ``images``, maybe ``tools``) -> a batch."""

    def __init__(self, encoder: VisionEncoder):
        self.encoder = encoder

    def __call__(self, examples: list[dict]) -> dict[str, Any]:
        indices = [e.get("__index") for e in examples]
        rows = [{k: v for k, v in e.items() if k != "__index"} for e in examples]
        return self.encoder(rows, indices if all(i is not None for i in indices) else None)


# A vision-language model's vision tower and projector, by the names transformers gives them.
TOWER_NAMES = ("visual", "vision_tower", "vision_model", "vision_encoder", "image_encoder")
PROJECTOR_NAMES = ("multi_modal_projector", "connector", "merger", "mm_projector", "vision_projection")


def vision_parts(model: Any) -> tuple[list[str], list[str]]:
    """``(tower, projector)``: the module paths of a vision-language model's vision tower (its projector
    left out where it sits inside, as Qwen's ``visual.merger``) and of its projector; empty for a text model."""
    tower, projector = [], []
    for path, _ in model.named_modules():
        name = path.rsplit(".", 1)[-1]
        if name in PROJECTOR_NAMES and not any(path.startswith(p + ".") for p in projector):
            projector.append(path)
        elif name in TOWER_NAMES and not any(path.startswith(p + ".") for p in tower):
            tower.append(path)
    return tower, projector


def keep_vision_unquantized(config: Any, model: Any) -> Any:
    """A bitsandbytes config that leaves ``model``'s vision tower and projector (and what transformers
    leaves anyway: the output head) in the compute dtype: QLoRA quantizes the language model only."""
    import copy

    from transformers.quantizers.base import get_keys_to_not_convert

    tower, projector = vision_parts(model)
    if not tower and not projector:
        return config
    config = copy.deepcopy(config)
    config.llm_int8_skip_modules = list(dict.fromkeys([*(config.llm_int8_skip_modules or get_keys_to_not_convert(model)),
                                                       *tower, *projector]))
    return config


def attach_processor(tokenizer: Any, processor: Any) -> Any:
    """Give ``tokenizer`` (what a loader returns) the processor around it; returns the tokenizer."""
    tokenizer.ftcore_processor = processor
    return tokenizer


def processor_of(tokenizer: Any) -> Any | None:
    """The processor a loader attached to ``tokenizer``, or None (a text model). Public: an evaluator's
    ``processor_of(ctx.tokenizer)`` (docs/writing-plugins.md)."""
    return getattr(tokenizer, "ftcore_processor", None)


def prompt_inputs(tokenizer: Any, prompts: list[str], images: list[list] | None = None, *,
                  where: str = "prompts") -> Any:
    """Left-padded model inputs for rendered ``prompts``: the processor's (pixels and all) when any prompt
    has images (``images``: each prompt's image references, decoded here), else the tokenizer's. Images
    for a text model (no processor) are one line naming ``where``, never dropped. Public: an evaluator
    generates from image rows with it (docs/writing-plugins.md)."""
    processor = require_processor(tokenizer, where) if images and any(images) else None
    pads = getattr(processor, "tokenizer", tokenizer)  # the tokenizer that pads: the processor's own
    side, pads.padding_side = pads.padding_side, "left"  # decoder-only models generate from the right
    try:
        if processor is not None:
            decoded = [[load_image(ref) for ref in refs] for refs in images]
            return processor(text=prompts, images=decoded, add_special_tokens=False, padding=True,
                             return_tensors="pt")
        return tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        pads.padding_side = side


def require_processor(tokenizer: Any, where: str) -> Any:
    """The processor the loader attached to ``tokenizer``; one line when the model reads text only."""
    processor = processor_of(tokenizer)
    if processor is None:
        raise FtcoreError(f"{where}: the rows hold images, but the model is a text model (its loader gave no "
                          "processor); images need a vision-language model (docs/vision.md)")
    return processor


def has_images(data: Any) -> bool:
    """Whether a dataset holds chat rows with images (an ``images`` column)."""
    return data is not None and "images" in (getattr(data, "column_names", None) or [])
