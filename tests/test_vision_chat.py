"""`ftcore generate` and `ftcore chat` on a vision-language model's run (issue #31): prompts with images
answer as plain transformers answers them (processor and model), chat with --image and /image answers what
generate answers, and bad images or a text run are one line, exit 2."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TINY_HEADER, chat_rows, run_cli, text_rows, write_jsonl
from test_chat import chat_command, terminal  # noqa: F401  (terminal: fixture)
from test_vision_labels import TOKENIZERS
from test_vision_sft import write_data, write_plan

pytestmark = pytest.mark.skipif(not TOKENIZERS.is_dir(), reason="../shared/fixtures/tokenizers is absent")

QUESTION = "What colour is this square?"


@pytest.fixture(scope="module")
def vlm_run(tmp_path_factory) -> Path:
    """A LLaVA run trained on coloured squares (LoRA and the projector, 40 steps: it answers "It is ..." and
    its answers differ from image to image), with a merged export."""
    folder = tmp_path_factory.mktemp("vlm")
    write_data(folder)
    plan = write_plan(folder, "llava", '\n[[export]]\nuse = "merged"\n')
    plan.write_text(plan.read_text().replace("max_steps = 6", "max_steps = 40")
                    .replace("lora_alpha = 16 }", "lora_alpha = 16, train_projector = true }"))
    done = run_cli("run", str(plan), cwd=folder, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    return folder / "runs" / "plan"


@pytest.fixture(scope="module")
def text_run(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("text")
    write_jsonl(folder / "text.jsonl", text_rows(16))
    write_jsonl(folder / "chat.jsonl", chat_rows(16))
    write_jsonl(folder / "chat_eval.jsonl", chat_rows(4, seed=1))
    (folder / "plan.toml").write_text(TINY_HEADER + '\n[[stage]]\nname = "sft"\ntrainer = "sft"\ndata = "chat"\n'
                                      "max_steps = 1\nbatch_size = 2\n", encoding="utf-8")
    done = run_cli("run", "plan.toml", cwd=folder, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    return next((folder / "runs").iterdir())


def data(run: Path) -> Path:
    return run.parent.parent / "data"


def generate(run: Path, tmp_path: Path, rows: list[dict], *args: str, name: str = "prompts") -> list[dict]:
    """`ftcore generate` on ``rows`` written in ``tmp_path`` (image paths relative to that file)."""
    prompts = write_jsonl(tmp_path / f"{name}.jsonl", rows)
    out = tmp_path / f"{name}-answers.jsonl"
    done = run_cli("generate", str(run), "--input", str(prompts), "--output", str(out), "--force", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def plain_transformers(folder: Path, images: list[Path], max_new_tokens: int) -> str:
    """What plain transformers answers to QUESTION about ``images`` (all in the one user turn, before the
    text), greedily, from an exported model folder: AutoProcessor's chat template, the processor, generate."""
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    processor = AutoProcessor.from_pretrained(folder)
    messages = [{"role": "user", "content": [*({"type": "image"} for _ in images), {"type": "text", "text": QUESTION}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=[text], images=[[Image.open(p).convert("RGB") for p in images]], add_special_tokens=False,
                       return_tensors="pt")
    tokenizer = processor.tokenizer
    stops = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|eot_id|>")]
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stops,
                             pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()


# -- generate ---------------------------------------------------------------------------------------------

def test_generate_answers_image_rows_as_plain_transformers(vlm_run, tmp_path):
    """Each way a row holds images, paths relative to the input file: the merged export answers as plain
    transformers answers from the same folder, and the run's own model (base + adapter) answers the same."""
    folder = tmp_path / "prompts"
    folder.mkdir()
    for color in ("red", "blue"):
        (folder / f"{color}.png").write_bytes((data(vlm_run) / f"{color}.png").read_bytes())
    red_url = "data:image/png;base64," + base64.b64encode((folder / "red.png").read_bytes()).decode()
    rows = [
        {"prompt": QUESTION, "images": ["red.png"], "id": "string prompt"},
        {"messages": [{"role": "user", "content": [{"type": "image", "image": "blue.png"},
                                                   {"type": "text", "text": QUESTION}]}]},
        {"messages": [{"role": "user", "content": "<image>" + QUESTION},
                      {"role": "assistant", "content": "It is red."}],
         "images": [red_url]},
        {"prompt": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "blue.png"}},
                                                 {"type": "text", "text": QUESTION}]}]},
    ]
    merged = generate(vlm_run, folder, rows, "--export", "merged", "--max-new-tokens", "6", "--batch-size", "1")
    assert merged[0]["id"] == "string prompt"
    assert merged[0]["images"] == [str(folder / "red.png")] and merged[1]["images"] == [str(folder / "blue.png")]
    assert merged[2]["images"] == [red_url] and merged[2]["reference"] == "It is red."
    assert all(r["prompt"].count("<image>") == 1 for r in merged), merged  # the family's token, unexpanded
    assert merged[0]["prompt"] == merged[2]["prompt"]
    export = vlm_run / "exports" / "merged"
    red = plain_transformers(export, [folder / "red.png"], 6)
    blue = plain_transformers(export, [folder / "blue.png"], 6)
    assert [r["answer"] for r in merged] == [red, blue, red, blue]
    assert red.startswith("It is") and blue.startswith("It is") and red != blue, (red, blue)  # from the pixels

    # The run's final model (the base rebuilt, the adapter restored), in one batch with a text-only row.
    final = generate(vlm_run, folder, [*rows, {"prompt": QUESTION}], "--max-new-tokens", "6", name="final")
    assert [r["answer"] for r in final[:4]] == [red, blue, red, blue]
    assert "images" not in final[4] and "<image>" not in final[4]["prompt"]


def test_generate_on_a_lora_vlm_run_says_its_own_lines_only(vlm_run, tmp_path):
    """One prompt with a reference, on the LoRA run (peft imports bitsandbytes, whose CPU backend warns at import;
    transformers warns of a deprecation as the adapter loads; loading bars): stderr holds ftcore's own lines, as
    `ftcore chat` keeps it, and the summary counts one answer and one row in the singular."""
    from test_chat import NOISE

    (tmp_path / "red.png").write_bytes((data(vlm_run) / "red.png").read_bytes())
    prompts = write_jsonl(tmp_path / "one.jsonl", [{"messages": [{"role": "user", "content": "<image>" + QUESTION},
                                                                 {"role": "assistant", "content": "It is red."}],
                                                    "images": ["red.png"]}])
    out = tmp_path / "answers.jsonl"
    done = run_cli("generate", str(vlm_run), "--input", str(prompts), "--output", str(out), "--max-new-tokens", "4")
    assert done.returncode == 0, done.stderr[-3000:]
    assert not [word for word in NOISE if word in done.stderr], done.stderr
    summary = done.stderr.strip().splitlines()[-1]
    assert summary.startswith(f"wrote 1 answer to {out} (") and "; 1 row has a reference: exact match " in summary, \
        summary


def error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def generate_error(run: Path, tmp_path: Path, rows: list[dict], *args: str) -> str:
    prompts = write_jsonl(tmp_path / "bad.jsonl", rows)
    out = tmp_path / "out.jsonl"
    line = error_line(run_cli("generate", str(run), "--input", str(prompts), "--output", str(out), *args))
    assert not out.exists()
    return line


def test_bad_images_in_generate_are_one_line_naming_the_file_row_and_image(vlm_run, tmp_path):
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "notes.png").write_text("not an image")
    good = {"prompt": QUESTION, "images": [str(data(vlm_run) / "red.png")]}
    shown = tmp_path / "bad.jsonl"
    assert generate_error(vlm_run, tmp_path, [good, {"prompt": QUESTION, "images": ["nope.png"]}]) == \
        f"error: {shown}:2: image 1 (images[0]): {tmp_path / 'nope.png'}: no such file"
    assert generate_error(vlm_run, tmp_path, [good, good, {"messages": [{"role": "user", "content": [
        {"type": "image", "image": "empty.png"}, {"type": "text", "text": QUESTION}]}]}]) == \
        f"error: {shown}:3: image 1 (messages[0].content[0]): {tmp_path / 'empty.png'}: zero-size file"
    assert generate_error(vlm_run, tmp_path, [{"prompt": QUESTION, "images": ["notes.png"]}]) == \
        f"error: {shown}:1: image 1 (images[0]): {tmp_path / 'notes.png'}: not an image PIL can read"
    assert generate_error(vlm_run, tmp_path, [{"prompt": "<image><image>" + QUESTION, "images": good["images"]}]) \
        .startswith(f"error: {shown}:1: the text holds 2 <image> placeholder(s) but the row has 1 image(s)")
    assert generate_error(vlm_run, tmp_path, [{"prompt": QUESTION, "images": ["http://example.com/a.png"]}]) \
        .startswith(f"error: {shown}:1: image 1 (images[0]): http://example.com/a.png is a remote URL")
    assert generate_error(vlm_run, tmp_path, [good], "--raw").startswith(
        f"error: {shown}:1: a --raw prompt is given to the model as it is")


def test_a_text_run_refuses_image_rows_in_one_line(text_run, vlm_run, tmp_path):
    red = str(data(vlm_run) / "red.png")
    line = generate_error(text_run, tmp_path, [{"prompt": "hello"}, {"prompt": QUESTION, "images": [red]}])
    assert line == (f"error: {tmp_path / 'bad.jsonl'}:2: this row holds 1 image(s), and {text_run}'s model is a text "
                    "model, which reads text only; images need a vision-language model's run (docs/vision.md)")
    assert error_line(run_cli("chat", str(text_run), "--image", red)) == \
        (f"error: --image: {text_run}'s model is a text model, which reads no images; images need a "
         "vision-language model's run (docs/vision.md)")


# -- chat ---------------------------------------------------------------------------------------------------

def chat(run: Path, script: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ftcore", "chat", str(run), *args], input=script, cwd=cwd,
                          capture_output=True, text=True, timeout=3600)


def test_chat_with_images_answers_as_generate(vlm_run, tmp_path):
    """--image goes with the first message, /image with the next; the answers are generate's, greedy, on the
    same conversations and images (the same run and max_new_tokens)."""
    red, blue = data(vlm_run) / "red.png", data(vlm_run) / "blue.png"
    first, third = (r["answer"] for r in generate(vlm_run, tmp_path, [
        {"prompt": QUESTION, "images": [str(red)]}, {"prompt": QUESTION}],
        "--max-new-tokens", "6", "--batch-size", "1"))
    assert first.startswith("It is")
    # The second turn holds the first answer, as the chat's history does.
    [second] = [r["answer"] for r in generate(vlm_run, tmp_path, [
        {"messages": [{"role": "user", "content": "<image>" + QUESTION}, {"role": "assistant", "content": first},
                      {"role": "user", "content": "<image>" + QUESTION}], "images": [str(red), str(blue)]},
    ], "--max-new-tokens", "6", name="second")]

    script = f"{QUESTION}\n/image nope.png\n/image data/blue.png\n{QUESTION}\n/reset\n{QUESTION}\n"
    done = chat(vlm_run, script, "--image", str(red), "--max-new-tokens", "6", cwd=data(vlm_run).parent)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert f"(1 image(s) go with your first message: {red})" in out
    assert f"you> {first}\n" in out
    assert f"/image: {data(vlm_run).parent / 'nope.png'}: no such file\n" in out  # the chat goes on
    assert f"(image {blue} goes with your next message)\n" in out
    assert f"you> {second}\n" in out
    assert out.rstrip().endswith(f"you> {third}\nyou>")  # after /reset: no image, nothing before
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_chat_with_an_image_in_a_real_terminal(vlm_run, tmp_path, terminal):
    """The issue's acceptance: in tmux, `chat --image` answers what `generate` answers (greedy), /image
    attaches the next image, Ctrl-D quits with status 0."""
    red, blue = data(vlm_run) / "red.png", data(vlm_run) / "blue.png"
    [first] = [r["answer"] for r in generate(vlm_run, tmp_path, [{"prompt": QUESTION, "images": [str(red)]}],
                                             "--max-new-tokens", "6")]
    [second] = [r["answer"] for r in generate(vlm_run, tmp_path, [
        {"messages": [{"role": "user", "content": "<image>" + QUESTION}, {"role": "assistant", "content": first},
                      {"role": "user", "content": "<image>" + QUESTION}], "images": [str(red), str(blue)]},
    ], "--max-new-tokens", "6", name="second")]
    terminal.type(chat_command(vlm_run, "--image", str(red), "--max-new-tokens", "6"))
    header = terminal.wait(r"^you>\s*$")
    assert f"(1 image(s) go with your first message: {red})" in header
    assert terminal.say(QUESTION) == [first]
    assert terminal.say(f"/image {blue}") == [f"(image {blue} goes with your next message)"]
    assert terminal.say(QUESTION) == [second]
    terminal.send("C-d")
    screen = terminal.wait(r"^EXIT=\d+$")
    assert re.search(r"^EXIT=0$", screen, re.M) and "Traceback" not in screen, screen


def test_chat_image_errors_are_one_line(vlm_run, tmp_path):
    assert error_line(run_cli("chat", str(vlm_run), "--image", str(tmp_path / "nope.png"))) == \
        f"error: --image {tmp_path / 'nope.png'}: {tmp_path / 'nope.png'}: no such file"
    (tmp_path / "empty.png").write_bytes(b"")
    assert error_line(run_cli("chat", str(vlm_run), "--image", str(tmp_path / "empty.png"))) == \
        f"error: --image {tmp_path / 'empty.png'}: {tmp_path / 'empty.png'}: zero-size file"
