"""Tiny vision-language models from a config, random init, with a real tokenizer: the ``scratch``
loader's VLM families (``architecture = "qwen2_5_vl" | "mllama" | "gemma3" | "llava" | "idefics3"``).

Each family gets its model class, a processor built offline (the image processor from its class
defaults with a small image size, the plan's tokenizer with the family's image tokens added where it
lacks them) and the family's chat template: the one the models ship (TRL keeps byte-identical copies
of Qwen2.5-VL's, Gemma 3's and SmolVLM's), or for Llama 3.2 Vision and LLaVA (Llama 3 style) the
shipped template's turn format with its image token. Sizes are tiny: a forward pass takes milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Llama 3.2 Vision's turn format (as Llama-3.2-11B-Vision-Instruct renders it, without its tool and date
# preamble): an image part is <|image|>, text parts follow in order.
LLAMA3_VISION = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- IMAGE }}{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "mllama", "gemma3", "llava", "idefics3")


@dataclass(frozen=True)
class Family:
    architecture: str
    image_token: str  # the token the processor expands into an image's tokens (or, Mllama, keeps)
    # tokens that are never trained: the image token and what frames it
    vision_tokens: tuple[str, ...]


SPECS = {
    "qwen2_5_vl": Family("qwen2_5_vl", "<|image_pad|>", ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>",
                                                          "<|video_pad|>", "<|vision_pad|>")),
    "qwen3_vl": Family("qwen3_vl", "<|image_pad|>", ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>",
                                                      "<|video_pad|>", "<|vision_pad|>")),
    "mllama": Family("mllama", "<|image|>", ("<|image|>",)),
    "gemma3": Family("gemma3", "<image_soft_token>", ("<start_of_image>", "<image_soft_token>", "<end_of_image>")),
    "llava": Family("llava", "<image>", ("<image>",)),
    "idefics3": Family("idefics3", "<image>", ("<image>", "<fake_token_around_image>", "<global-img>")),
}


def _trl_template(name: str) -> str:
    from importlib.resources import files

    return (files("trl") / "chat_templates" / f"{name}.jinja").read_text()


def _add(tokenizer: Any, tokens: list[str]) -> None:
    vocab = tokenizer.get_vocab()  # once: a 128k vocabulary takes 0.2 s to list
    missing = [t for t in tokens if t not in vocab]
    if missing:
        tokenizer.add_special_tokens({"additional_special_tokens": missing}, replace_extra_special_tokens=False)


def _llama3_turns(tokenizer: Any) -> None:
    """Llama 3's turn tokens, for a tokenizer that lacks them (one trained on the data): the template
    writes them, and its BOS."""
    _add(tokenizer, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    if tokenizer.bos_token is None:
        tokenizer.bos_token = "<|begin_of_text|>"


def _text(tokenizer: Any, hidden: int, layers: int, heads: int) -> dict:
    return dict(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=1, intermediate_size=2 * hidden, max_position_embeddings=4096,
                pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id)


def _config(cls: type, overrides: dict | None, **fields: Any) -> Any:
    """``cls(**fields)`` with the plan's ``config`` table over it: a ``text_config`` or ``vision_config``
    table changes the fields it names and keeps the others (a bigger vision tower: ``vision_config =
    { hidden_size = 64, num_hidden_layers = 2 }``); any other key replaces the field."""
    for key, value in (overrides or {}).items():
        if isinstance(value, dict) and isinstance(fields.get(key), dict):
            fields[key] = {**fields[key], **value}
        else:
            fields[key] = value
    return cls(**fields)


def _without_video(cls: type) -> type:
    """Qwen2.5-VL's processor requires a video processor, which needs torchvision; images need none.
    This one has no video processor at all (so it also saves without one)."""

    class ImageOnly(cls):
        @classmethod
        def get_attributes(cls):
            return [a for a in super().get_attributes() if a != "video_processor"]

    ImageOnly.__name__ = ImageOnly.__qualname__ = cls.__name__
    return ImageOnly


def build(architecture: str, tokenizer: Any, *, hidden_size: int = 32, num_layers: int = 2,
          num_heads: int = 2, config: dict | None = None, device: str | None = None) -> tuple[Any, Any]:
    """``(model, processor)``: a randomly initialised ``architecture`` model (float32) whose language
    model is ``hidden_size`` wide and ``num_layers`` deep, and its processor around ``tokenizer`` (image
    tokens added where it lacks them). ``config`` overrides top-level config fields; ``device = "meta"``
    builds the model with no weights (shapes only)."""
    import torch

    model_cls, cfg, processor = parts(architecture, tokenizer, hidden_size=hidden_size, num_layers=num_layers,
                                      num_heads=num_heads, config=config)
    if device is not None:
        with torch.device(device):
            return model_cls(cfg), processor
    return model_cls(cfg), processor


def processor_for(architecture: str, tokenizer: Any, config: dict | None = None) -> Any:
    """The family's processor around ``tokenizer`` (image tokens added where it lacks them), no model;
    ``config`` as :func:`build` takes it (the processor follows the vision tower's sizes it sets)."""
    return parts(architecture, tokenizer, config=config)[2]


def parts(architecture: str, tokenizer: Any, *, hidden_size: int = 32, num_layers: int = 2,
          num_heads: int = 2, config: dict | None = None) -> tuple[type, Any, Any]:
    """``(model class, config, processor)`` of a tiny ``architecture`` model (see :func:`build`)."""
    import transformers as T

    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    text = None  # built after the image tokens are added: the vocabulary counts them
    small_vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    if architecture == "qwen2_5_vl":
        processor = _without_video(T.Qwen2_5_VLProcessor)(
            image_processor=T.Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 56),
            tokenizer=tokenizer, chat_template=_trl_template("qwen2_5_vl"))
        ids = tokenizer.convert_tokens_to_ids
        text = _text(tokenizer, hidden_size, num_layers, num_heads)
        half = hidden_size // num_heads // 2  # the rotary frequencies: split over time, height and width
        t, h = half // 4, (half - half // 4) // 2
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [t, h, half - t - h]}
        cfg = _config(T.Qwen2_5_VLConfig, config,
            text_config=text,
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=hidden_size,
                               fullatt_block_indexes=[0], window_size=56),
            image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
            vision_start_token_id=ids("<|vision_start|>"))
        model_cls = T.Qwen2_5_VLForConditionalGeneration
    elif architecture == "qwen3_vl":
        processor = _without_video(T.Qwen3VLProcessor)(
            image_processor=T.Qwen2VLImageProcessorPil(min_pixels=64 * 64, max_pixels=64 * 64, patch_size=16,
                                                       merge_size=2),
            tokenizer=tokenizer, chat_template=_trl_template("qwen3_vl"))
        ids = tokenizer.convert_tokens_to_ids
        text = _text(tokenizer, hidden_size, num_layers, num_heads)
        half = hidden_size // num_heads // 2
        t, h = half // 4, (half - half // 4) // 2
        text.update(head_dim=hidden_size // num_heads,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [t, h, half - t - h],
                                     "mrope_interleaved": True})
        cfg = _config(T.Qwen3VLConfig, config,
            text_config=text,
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=hidden_size,
                               patch_size=16, num_position_embeddings=16, deepstack_visual_indexes=[0]),
            image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
            vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))
        model_cls = T.Qwen3VLForConditionalGeneration
    elif architecture == "mllama":
        _llama3_turns(tokenizer)
        _add(tokenizer, ["<|image|>"])
        image = T.MllamaImageProcessorPil(size={"height": 28, "width": 28}, max_image_tiles=1)
        processor = T.MllamaProcessor(image_processor=image, tokenizer=tokenizer,
                                      chat_template=LLAMA3_VISION.replace("IMAGE", "'<|image|>'"))
        text = _text(tokenizer, hidden_size, num_layers, num_heads)
        text["cross_attention_layers"] = [num_layers - 1]
        cfg = _config(T.MllamaConfig, config,
            text_config=text,
            vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_global_layers=1,
                               attention_heads=2, image_size=28, patch_size=14, max_num_tiles=1,
                               intermediate_layers_indices=[0], vision_output_dim=32,
                               supported_aspect_ratios=[[1, 1]]),
            image_token_index=tokenizer.convert_tokens_to_ids("<|image|>"))
        model_cls = T.MllamaForConditionalGeneration
    elif architecture == "gemma3":
        _add(tokenizer, ["<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<image_soft_token>",
                         "<end_of_image>"])
        if tokenizer.bos_token is None:
            tokenizer.bos_token = "<bos>"
        # Named special tokens, as Gemma 3's tokenizer has them (saved in tokenizer_config.json, so a saved
        # processor loads again)
        tokenizer._set_model_specific_special_tokens(
            {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
        image = T.Gemma3ImageProcessorPil(size={"height": 28, "width": 28})
        processor = T.Gemma3Processor(image_processor=image, tokenizer=tokenizer, image_seq_length=4,
                                      chat_template=_trl_template("gemma3"))
        text = _text(tokenizer, hidden_size, num_layers, num_heads)
        text["head_dim"] = hidden_size // num_heads
        ids = tokenizer.convert_tokens_to_ids
        cfg = _config(T.Gemma3Config, config,
            text_config=text,
            vision_config=dict(**small_vision, image_size=28, patch_size=7),
            mm_tokens_per_image=4, image_token_id=ids("<image_soft_token>"), boi_token_id=ids("<start_of_image>"),
            eoi_token_id=ids("<end_of_image>"))
        model_cls = T.Gemma3ForConditionalGeneration
    elif architecture == "llava":
        _llama3_turns(tokenizer)
        _add(tokenizer, ["<image>"])
        # The processor follows the tower's picture and patch sizes where the plan's config sets them.
        tower = {"image_size": 28, "patch_size": 14, **(config or {}).get("vision_config", {})}
        side, patch = tower["image_size"], tower["patch_size"]
        image = T.CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
        processor = T.LlavaProcessor(image_processor=image, tokenizer=tokenizer, patch_size=patch,
                                     vision_feature_select_strategy="full", num_additional_image_tokens=1,
                                     chat_template=LLAMA3_VISION.replace("IMAGE", "'<image>\\n'"))
        cfg = _config(T.LlavaConfig, config,
            text_config={"model_type": "llama", **_text(tokenizer, hidden_size, num_layers, num_heads)},
            vision_config={"model_type": "clip_vision_model", **small_vision, "image_size": 28, "patch_size": 14,
                           "projection_dim": 16},
            image_token_id=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_select_strategy="full",
            vision_feature_layer=-1)
        model_cls = T.LlavaForConditionalGeneration
    elif architecture == "idefics3":
        image = T.Idefics3ImageProcessorPil(size={"longest_edge": 28}, max_image_size={"longest_edge": 28},
                                            do_image_splitting=False)
        processor = T.Idefics3Processor(image_processor=image, tokenizer=tokenizer, image_seq_len=1,
                                        chat_template=_trl_template("smolvlm"))
        _add(tokenizer, ["<global-img>"])
        cfg = _config(T.Idefics3Config, config,
            text_config={"model_type": "llama", **_text(tokenizer, hidden_size, num_layers, num_heads)},
            vision_config=dict(**small_vision, image_size=28, patch_size=14),
            scale_factor=2, image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
        model_cls = T.Idefics3ForConditionalGeneration
    else:
        raise ValueError(f"unknown vision architecture {architecture!r}; known: {', '.join(FAMILIES)}")
    tokenizer.chat_template = processor.chat_template  # template "native" renders with the processor's own
    return model_cls, cfg, processor
