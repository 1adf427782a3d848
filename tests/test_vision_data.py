"""Chat rows with images (issue #31): every row format and image reference a source reads, and one exact
line for each bad image (missing, zero-size, unreadable, truncated, a count that does not match the
placeholders), or a counted skip. Images are kept as references; nothing is decoded into the data."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest

from test_bad_data import error, lines, source, write
from test_sources import datasets_cache, load_data  # noqa: F401  (datasets_cache: autouse fixture)

from ftcore_plugins.common import formats as F
from ftcore_plugins.common.images import IMAGE, load_image


def png(color: str = "red", size: tuple[int, int] = (12, 8)) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


def image_file(folder: Path, name: str, content: bytes | None = None) -> Path:
    path = folder / "data" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(png() if content is None else content)
    return path


def answer(text: str = "A red box.") -> dict:
    return {"role": "assistant", "content": text}


def test_openai_parts_become_placeholders_and_references(tmp_path):
    image_file(tmp_path, "img/a.png")
    blue = "data:image/png;base64," + base64.b64encode(png("blue")).decode()
    row = {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image", "image": "img/a.png"},
                                     {"type": "text", "text": " and "}, {"type": "image_url", "image_url": {"url": blue}}]},
        answer("Red, then blue.")]}
    loaded = load_data(tmp_path, source("jsonl", write(tmp_path, "d.jsonl", lines(row))))
    out = loaded.ds[0]
    assert out["messages"][0]["content"] == f"Compare {IMAGE} and {IMAGE}"
    assert out["images"] == [str((tmp_path / "data" / "img" / "a.png").resolve()), blue]
    assert [load_image(r).getpixel((0, 0)) for r in out["images"]] == [(255, 0, 0), (0, 0, 255)]
    assert loaded.ds.features["images"].feature.dtype == "string"  # references, never pixels


def test_llamafactory_images_with_and_without_placeholders(tmp_path):
    a, b = image_file(tmp_path, "a.png"), image_file(tmp_path, "b.png")
    rows = [
        # placeholders: images go where they are, in order; file:// URLs read as paths
        {"messages": [{"role": "user", "content": f"First {IMAGE} then {IMAGE}?"}, answer()],
         "images": ["a.png", f"file://{b}"]},
        # none: all before the first user turn's text (LLaMA-Factory's rule), multi-turn kept
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What?"}, answer(),
                      {"role": "user", "content": "And now?"}, answer("Still red.")], "images": ["a.png"]},
    ]
    ds = load_data(tmp_path, source("jsonl", write(tmp_path, "d.jsonl", lines(*rows)))).ds
    assert ds[0]["messages"][0]["content"] == f"First {IMAGE} then {IMAGE}?"
    assert ds[0]["images"] == [str(a), str(b)]
    assert [m["content"] for m in ds[1]["messages"]] == ["Be brief.", f"{IMAGE}What?", "A red box.", "And now?",
                                                         "Still red."]


def test_sharegpt_rows_with_images(tmp_path):
    image_file(tmp_path, "a.png")
    row = {"conversations": [{"from": "human", "value": f"{IMAGE}Color?"}, {"from": "gpt", "value": "Red."}],
           "images": ["a.png"]}
    loaded = load_data(tmp_path, source("json", write(tmp_path, "d.json", json.dumps([row]))))
    assert loaded.ds[0]["messages"][0]["content"] == f"{IMAGE}Color?"
    assert loaded.ds[0]["images"] == [str(tmp_path / "data" / "a.png")]


def test_parquet_image_bytes_are_kept_encoded(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"messages": [[{"role": "user", "content": "Color?"}, answer("Red.")]],
                      "images": [[{"bytes": png(), "path": "x.png"}]]})
    path = tmp_path / "data" / "d.parquet"
    path.parent.mkdir()
    pq.write_table(table, path)
    ds = load_data(tmp_path, source("parquet", "data/d.parquet")).ds
    ref = ds[0]["images"][0]
    assert ref.startswith("data:image/png;base64,") and load_image(ref).size == (12, 8)
    assert ds[0]["messages"][0]["content"] == f"{IMAGE}Color?"


def test_text_rows_are_unchanged(tmp_path):
    row = {"messages": [{"role": "user", "content": "Hi <image> as text"}, answer("Hello")]}
    ds = load_data(tmp_path, source("jsonl", write(tmp_path, "d.jsonl", lines(row)))).ds
    assert ds.column_names == ["messages"]  # no images column when no row has images
    assert F.convert(row) == ("messages", "chat", {"messages": row["messages"], "tools": None})


# -- bad images: one line naming the file, the row and the image -------------------------------------

def test_missing_image(tmp_path):
    row = {"messages": [{"role": "user", "content": "?"}, answer()], "images": ["nope.png"]}
    path = write(tmp_path, "d.jsonl", lines({"messages": [{"role": "user", "content": "ok"}, answer()]}, row))
    assert error(tmp_path, source("jsonl", path)) == \
        f"data.train: data/d.jsonl:2: image 1 (images[0]): {tmp_path / 'data' / 'nope.png'}: no such file"


def test_zero_size_image(tmp_path):
    image_file(tmp_path, "empty.png", b"")
    row = {"messages": [{"role": "user", "content": [{"type": "image", "image": "empty.png"}]}, answer()]}
    assert error(tmp_path, source("jsonl", write(tmp_path, "d.jsonl", lines(row)))) == \
        f"data.train: data/d.jsonl:1: image 1 (messages[0].content[0]): {tmp_path / 'data' / 'empty.png'}: " \
        "zero-size file"


def test_unreadable_image(tmp_path):
    image_file(tmp_path, "a.png")
    image_file(tmp_path, "junk.png", b"this is not an image")
    row = {"messages": [{"role": "user", "content": f"{IMAGE}{IMAGE}"}, answer()], "images": ["a.png", "junk.png"]}
    assert error(tmp_path, source("jsonl", write(tmp_path, "d.jsonl", lines(row)))) == \
        f"data.train: data/d.jsonl:1: image 2 (images[1]): {tmp_path / 'data' / 'junk.png'}: not an image PIL can read"


def test_truncated_image(tmp_path):
    from PIL import Image

    out = io.BytesIO()
    Image.effect_noise((64, 64), 50).convert("RGB").save(out, format="PNG")
    image_file(tmp_path, "cut.png", out.getvalue()[: len(out.getvalue()) // 2])
    row = {"messages": [{"role": "user", "content": "?"}, answer()], "images": ["cut.png"]}
    message = error(tmp_path, source("jsonl", write(tmp_path, "d.jsonl", lines(row))))
    assert message.startswith(f"data.train: data/d.jsonl:1: image 1 (images[0]): {tmp_path / 'data' / 'cut.png'}: "
                              "unreadable image ("), message


def test_count_that_does_not_match_the_placeholders(tmp_path):
    image_file(tmp_path, "a.png")
    row = {"messages": [{"role": "user", "content": f"{IMAGE} and {IMAGE}?"}, answer()], "images": ["a.png"]}
    assert error(tmp_path, source("jsonl", write(tmp_path, "d.jsonl", lines(row)))) == \
        "data.train: data/d.jsonl:1: the text holds 2 <image> placeholder(s) but the row has 1 image(s); give one " \
        "image per placeholder (or no placeholder at all)"


def test_remote_url_is_never_fetched(tmp_path):
    row = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x.org/a.png"}},
                                                     {"type": "text", "text": "?"}]}, answer()]}
    assert error(tmp_path, source("jsonl", write(tmp_path, "d.jsonl", lines(row)))) == \
        "data.train: data/d.jsonl:1: image 1 (messages[0].content[0]): https://x.org/a.png is a remote URL; images " \
        "are never fetched from the network (download them and give local paths)"


def test_bad_images_are_counted_and_skipped(tmp_path):
    image_file(tmp_path, "a.png")
    image_file(tmp_path, "empty.png", b"")
    good = {"messages": [{"role": "user", "content": "?"}, answer()], "images": ["a.png"]}
    rows = [good, {**good, "images": ["gone.png"]}, {**good, "images": ["empty.png"]}, good,
            {"messages": [{"role": "user", "content": f"{IMAGE}?"}, answer()], "images": ["a.png", "a.png"]}]
    loaded = load_data(tmp_path, source("jsonl", write(tmp_path, "d.jsonl", lines(*rows)), 'on_error = "skip"'))
    assert len(loaded.ds) == 2
    skipped = json.dumps(loaded.stats)
    for reason in ("missing_image", "empty_image", "image_count"):
        assert reason in skipped, skipped


def test_a_bad_image_through_the_cli_is_one_line_and_exit_2(tmp_path):
    from conftest import run_cli

    row = {"messages": [{"role": "user", "content": "?"}, answer()], "images": ["missing.png"]}
    write(tmp_path, "d.jsonl", lines(row))
    (tmp_path / "plan.toml").write_text('[model]\nuse = "scratch"\ntokenizer_data = ["train"]\n\n'
                                        '[data.train]\nuse = "jsonl"\npath = "data/d.jsonl"\n\n'
                                        '[[stage]]\nname = "sft"\ntrainer = "sft"\ndata = "train"\nmax_steps = 1\n')
    done = run_cli("prepare", "plan.toml", cwd=tmp_path, timeout=600)
    assert done.returncode == 2, done.stderr
    lines_ = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines_) == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"data/d.jsonl:1: image 1 (images[0]): {tmp_path / 'data' / 'missing.png'}: no such file" in lines_[0]


def test_preference_pairs_with_images(tmp_path):
    """LLaMA-Factory's DPO rows (ShareGPT conversations + chosen/rejected + images) and prompt pairs: the
    images belong to the prompt."""
    image_file(tmp_path, "a.png")
    rows = [{"conversations": [{"from": "human", "value": "<image>Colour?"}], "chosen": {"from": "gpt", "value": "Red."},
             "rejected": {"from": "gpt", "value": "Blue."}, "images": ["a.png"]},
            {"conversations": [{"from": "human", "value": "Colour?"}], "chosen": {"from": "gpt", "value": "Red."},
             "rejected": {"from": "gpt", "value": "Blue."}, "images": ["a.png"]}]
    ds = load_data(tmp_path, source("jsonl", write(tmp_path, "d.jsonl", lines(*rows)))).ds
    assert [r["prompt"][0]["content"] for r in ds] == [f"{IMAGE}Colour?"] * 2
    assert ds[0]["images"] == [str(tmp_path / "data" / "a.png")] and ds[0]["chosen"][0]["content"] == "Red."
    pair = {"prompt": "Colour?", "chosen": f"Red {IMAGE}", "rejected": "Blue.", "images": ["a.png"]}
    assert error(tmp_path, source("jsonl", write(tmp_path, "p.jsonl", lines(pair)))) == \
        "data.train: data/p.jsonl:1: 'chosen' holds <image>: a pair's images go in its prompt"


def test_images_in_a_format_that_does_not_read_them_are_refused(tmp_path):
    """Never dropped without a word: an Alpaca row with images is one line (not read yet)."""
    image_file(tmp_path, "a.png")
    row = {"instruction": "Colour?", "output": "Red.", "images": ["a.png"]}
    assert error(tmp_path, source("jsonl", write(tmp_path, "d.jsonl", lines(row)))) == \
        "data.train: data/d.jsonl:1: alpaca rows with images are not read yet: images are read in chat rows " \
        "(messages, ShareGPT conversations) and preference pairs with a prompt"


def test_validate_data_reads_images_relative_to_the_data_file(tmp_path):
    """`ftcore validate --data` finds each image where a run finds it, beside the data file (not in the
    working folder), renders each row with its image parts, and names a missing image by file, row and image."""
    from conftest import run_cli
    from test_vision_labels import FAMILIES, TOKENIZERS

    if not TOKENIZERS.is_dir():
        pytest.skip("../shared/fixtures/tokenizers is absent")
    image_file(tmp_path, "img/a.png")
    good = {"messages": [{"role": "user", "content": "<image>What is it?"}, answer()], "images": ["img/a.png"]}
    write(tmp_path, "d.jsonl", lines(good, good))
    plan = tmp_path / "plan.toml"
    plan.write_text(f'[model]\nuse = "scratch"\narchitecture = "llava"\nhidden_size = 32\nnum_layers = 1\n'
                    f'num_heads = 2\ntokenizer = "{TOKENIZERS / FAMILIES["llava"][0]}"\n\n[template]\nuse = "native"\n\n'
                    '[data.train]\nuse = "jsonl"\npath = "data/d.jsonl"\n\n'
                    '[[stage]]\nname = "sft"\ntrainer = "sft"\ndata = "train"\nmax_steps = 1\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = run_cli("validate", str(plan), "--data", cwd=elsewhere, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "data: 2 rows read from 1 file(s) in 1 source(s); no bad rows" in done.stdout
    write(tmp_path, "d.jsonl", lines(good, {**good, "images": ["img/gone.png"]}))
    done = run_cli("validate", str(plan), "--data", cwd=elsewhere, timeout=600)
    assert done.returncode == 2
    assert f"data.train: data/d.jsonl:2: image 1 (images[0]): {tmp_path / 'data' / 'img' / 'gone.png'}: no such file" \
        in done.stderr, done.stderr


def test_validate_data_on_a_tokenizer_trained_on_rows_with_a_missing_image(tmp_path):
    """The vision example's way: a scratch LLaVA whose tokenizer is trained on the same rows. A missing image is
    one line, and the tokenizer is trained on the rows that load, so the others are still rendered: with a
    template that renders text only, each of them says so."""
    from conftest import run_cli

    image_file(tmp_path, "a.png")
    good = {"messages": [{"role": "user", "content": "<image>What is it?"}, answer()], "images": ["a.png"]}
    write(tmp_path, "d.jsonl", lines(good, {**good, "images": ["gone.png"]}, good))
    plan = tmp_path / "plan.toml"
    head = '[model]\nuse = "scratch"\narchitecture = "llava"\nhidden_size = 32\nnum_layers = 1\nnum_heads = 2\n' \
           'tokenizer_data = ["train"]\nvocab_size = 300\n\n[template]\nuse = "{}"\n\n'
    body = '[data.train]\nuse = "jsonl"\npath = "data/d.jsonl"\n\n[[stage]]\nname = "sft"\ntrainer = "sft"\n' \
           'data = "train"\nmax_steps = 1\n'
    missing = f"data.train: data/d.jsonl:2: image 1 (images[0]): {tmp_path / 'data' / 'gone.png'}: no such file"
    plan.write_text(head.format("native") + body)
    done = run_cli("validate", str(plan), "--data", cwd=tmp_path, timeout=600)
    assert done.returncode == 2 and done.stderr.splitlines() == [missing], done.stderr
    assert "data: 3 rows read from 1 file(s) in 1 source(s); 1 bad (missing image: 1); 1 would stop the run" \
        in done.stdout
    plan.write_text(head.format("chatml") + body)
    done = run_cli("validate", str(plan), "--data", cwd=tmp_path, timeout=600)
    assert done.returncode == 2 and done.stderr.splitlines() == [
        "data.train: data/d.jsonl:1 (and 1 more row(s) like it): cannot render with the template: template 'chatml' "
        "renders text only, and these rows hold images; use [template] use = \"native\" (the processor's chat "
        "template) or a \"jinja\" file that renders image parts", missing], done.stderr
