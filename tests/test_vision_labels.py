"""Assistant-only labels on rows with images, for six VLM families (issue #31, acceptance 1): tiny
random-init models from configs, the real tokenizers in ../shared/fixtures/tokenizers (image tokens added
where a tokenizer lacks them) and each family's chat template.

The expected labels come from an independent source, as in test_template_conformance.py: a hand-written
description of each family's assistant turn (the text that opens it and the token that closes it), applied
with a regular expression to the processor's expanded input decoded. Labelled tokens must decode to
exactly those turns, each the assistant's text plus its end-of-turn token, and no image or vision
placeholder token may be labelled."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from conftest import SHARED

TOKENIZERS = SHARED / "tokenizers"
pytestmark = pytest.mark.skipif(not TOKENIZERS.is_dir(), reason="../shared/fixtures/tokenizers is absent")

# family -> (fixture tokenizer, what opens an assistant turn, what closes it, the family's image tokens)
FAMILIES = {
    "qwen2_5_vl": ("qwen25", "<|im_start|>assistant\n", "<|im_end|>",
                   ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")),
    "qwen3_vl": ("qwen3", "<|im_start|>assistant\n", "<|im_end|>",
                 ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")),
    "mllama": ("llama3", "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>", ("<|image|>",)),
    "gemma3": ("qwen3", "<start_of_turn>model\n", "<end_of_turn>",
               ("<start_of_image>", "<image_soft_token>", "<end_of_image>")),
    "llava": ("llama3", "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>", ("<image>",)),
    "idefics3": ("qwen3", "Assistant:", "<end_of_utterance>", ("<image>", "<fake_token_around_image>", "<global-img>")),
}


def png(color: str) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (40, 30), color).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> list[str]:
    folder = tmp_path_factory.mktemp("images")
    paths = []
    for color in ("red", "blue"):
        (folder / f"{color}.png").write_bytes(png(color))
        paths.append(str(folder / f"{color}.png"))
    return paths


def rows(images: list[str]) -> dict[str, dict]:
    red, blue = images
    return {
        "single": {"messages": [{"role": "user", "content": "<image>What colour is this?"},
                                {"role": "assistant", "content": "It is red."}], "images": [red]},
        "multi_image": {"messages": [{"role": "user", "content": "Compare <image> with <image>."},
                                     {"role": "assistant", "content": "Red, then blue."}], "images": [red, blue]},
        "multi_turn": {"messages": [{"role": "system", "content": "Answer briefly."},
                                    {"role": "user", "content": "<image>Colour?"},
                                    {"role": "assistant", "content": "Red."},
                                    {"role": "user", "content": "And this one? <image>"},
                                    {"role": "assistant", "content": "Blue, unlike the first."}],
                       "images": [red, blue]},
    }


_BUILT: dict[str, tuple] = {}


def built(family: str) -> tuple:
    """(model, processor) of a tiny ``family`` model, built once per test session."""
    if family not in _BUILT:
        import torch
        from transformers import AutoTokenizer

        from ftcore_plugins.models import _vlm

        tokenizer = AutoTokenizer.from_pretrained(TOKENIZERS / FAMILIES[family][0])
        torch.manual_seed(0)
        _BUILT[family] = _vlm.build(family, tokenizer)
    return _BUILT[family]


def native():
    from ftcore_plugins.templates.native import NativeTemplate

    return NativeTemplate.create({}) if hasattr(NativeTemplate, "create") else NativeTemplate(NativeTemplate.Options())


def runs(labels: list[int]) -> list[list[int]]:
    out, current = [], []
    for label in labels:
        if label == -100:
            if current:
                out.append(current)
            current = []
        else:
            current.append(label)
    return out + ([current] if current else [])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_labels_are_exactly_the_assistant_turns(family, images):
    from ftcore_plugins.common.vision import VisionEncoder

    _, processor = built(family)
    tokenizer = processor.tokenizer
    _, opener, closer, image_tokens = FAMILIES[family]
    image_ids = {tokenizer.convert_tokens_to_ids(t) for t in image_tokens}
    encoder = VisionEncoder(processor, native())
    for kind, row in rows(images).items():
        batch = encoder([row])
        ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
        rendered = tokenizer.decode(ids, skip_special_tokens=False)
        expected = re.findall(re.escape(opener) + r"(.*?" + re.escape(closer) + ")", rendered, flags=re.S)
        answers = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        # the family's description finds the turns, and each is the answer (after the one space SmolVLM's
        # template writes past its generation prompt) and its end-of-turn token
        assert [e.removeprefix(" ") for e in expected] == [a + closer for a in answers], (kind, rendered)
        got = [tokenizer.decode(run, skip_special_tokens=False) for run in runs(labels)]
        assert got == expected, (family, kind, got, rendered)
        assert not image_ids & {label for label in labels if label != -100}, (family, kind)
        assert sum(t in image_ids for t in ids) >= len(row["images"])  # the images are in the input


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_batch_mixing_image_and_text_rows(family, images):
    """Rows with and without images in one padded batch: each row's labels are its own assistant turn."""
    from ftcore_plugins.common.vision import VisionEncoder

    _, processor = built(family)
    tokenizer = processor.tokenizer
    closer = FAMILIES[family][2]
    text_row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]}
    batch = VisionEncoder(processor, native())([rows(images)["multi_image"], text_row])
    assert batch["input_ids"].shape == batch["labels"].shape and batch["input_ids"].shape[0] == 2
    for k, answer in enumerate(["Red, then blue.", "Hello there."]):
        got = [tokenizer.decode(run, skip_special_tokens=False) for run in runs(batch["labels"][k].tolist())]
        assert [g.removeprefix(" ") for g in got] == [answer + closer], (family, k, got)
        padding = batch["attention_mask"][k] == 0
        assert (batch["labels"][k][padding] == -100).all()


def test_a_jinja_file_renders_as_the_native_template(tmp_path, images):
    """[template] use = "jinja" with the family's template in a file labels exactly as "native"."""
    from ftcore_plugins.common.vision import VisionEncoder
    from ftcore_plugins.templates.jinja import JinjaFileTemplate

    _, processor = built("idefics3")
    (tmp_path / "smolvlm.jinja").write_text(processor.chat_template)
    jinja = JinjaFileTemplate(JinjaFileTemplate.Options(path=str(tmp_path / "smolvlm.jinja")))
    row = rows(images)["multi_turn"]
    native_batch, jinja_batch = VisionEncoder(processor, native())([row]), VisionEncoder(processor, jinja)([row])
    assert native_batch["input_ids"].tolist() == jinja_batch["input_ids"].tolist()
    assert native_batch["labels"].tolist() == jinja_batch["labels"].tolist()


def test_a_template_that_renders_text_only_is_refused(images):
    from ftcore.errors import FtcoreError
    from ftcore_plugins.common.vision import VisionEncoder
    from ftcore_plugins.templates.chatml import ChatMLTemplate

    _, processor = built("qwen2_5_vl")
    with pytest.raises(FtcoreError) as info:
        VisionEncoder(processor, ChatMLTemplate(ChatMLTemplate.Options()))
    assert str(info.value) == "template 'chatml' renders text only, and these rows hold images; use [template] use = " \
        "\"native\" (the processor's chat template) or a \"jinja\" file that renders image parts"


def test_max_length_cuts_the_response_never_an_image(images):
    from ftcore.errors import FtcoreError
    from ftcore_plugins.common.vision import VisionEncoder

    _, processor = built("llava")
    row = rows(images)["multi_turn"]
    full = VisionEncoder(processor, native())([row])
    n = full["input_ids"].shape[1]
    cut = VisionEncoder(processor, native(), max_length=n - 3)([row])
    assert cut["input_ids"].tolist()[0] == full["input_ids"].tolist()[0][:n - 3]
    assert cut["labels"].tolist()[0] == full["labels"].tolist()[0][:n - 3]
    with pytest.raises(FtcoreError) as info:
        VisionEncoder(processor, native(), max_length=8, where="data.train (d.jsonl)")([row])
    assert str(info.value) == f"data.train (d.jsonl), row 1: {n} tokens with its images, and max_length = 8 would cut " \
        "into an image; raise max_length"


def test_an_image_gone_since_the_data_was_read_names_the_row(tmp_path, images):
    from ftcore.errors import FtcoreError
    from ftcore_plugins.common.vision import VisionEncoder

    _, processor = built("llava")
    row = {**rows(images)["single"], "images": [str(tmp_path / "gone.png")]}
    with pytest.raises(FtcoreError) as info:
        VisionEncoder(processor, native(), where="data.train (d.jsonl)")([rows(images)["single"], row], [4, 5])
    assert str(info.value) == f"data.train (d.jsonl), row 6: {tmp_path / 'gone.png'}: no such file"
