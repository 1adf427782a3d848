"""Evaluators on rows with images (issue #31): `generation` (and `exact_match`) answers held-out image
questions as plain transformers answers them, `perplexity` is the model's own loss on the labelled tokens,
and what they cannot evaluate is one line. Then the vision example, shortened, end to end."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

import ftcore
from ftcore.component import Component

from conftest import ROOT, run_cli
from test_vision_labels import TOKENIZERS, built, native, png

pytestmark = pytest.mark.skipif(not TOKENIZERS.is_dir(), reason="../shared/fixtures/tokenizers is absent")


class Reporter:
    def warn(self, *a, **k):
        pass

    def info(self, *a, **k):
        pass

    def progress(self, *a, **k):
        import contextlib

        return contextlib.nullcontext(SimpleNamespace(advance=lambda n: None))


def rows(folder: Path) -> list[dict]:
    """Held-out rows: single image, two images, a second turn about the image, and a text row (mixed data)."""
    for color in ("red", "blue"):
        (folder / f"{color}.png").write_bytes(png(color))
    red, blue = str(folder / "red.png"), str(folder / "blue.png")
    return [{"messages": [{"role": "user", "content": "<image>What colour is this?"},
                          {"role": "assistant", "content": "red"}], "images": [red]},
            {"messages": [{"role": "user", "content": "Compare <image> with <image>."},
                          {"role": "assistant", "content": "red, blue"}], "images": [red, blue]},
            {"messages": [{"role": "user", "content": "<image>Colour?"}, {"role": "assistant", "content": "blue"},
                          {"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "yes"}],
             "images": [blue]},
            {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}],
             "images": []}]


def context(tmp_path: Path, data, *, processor: bool = True, template=None):
    import copy

    from ftcore_plugins.common.vision import attach_processor

    model, proc = built("llava")
    tokenizer = attach_processor(proc.tokenizer, proc)  # as a loader gives it: the processor's own tokenizer
    if not processor:  # a text model's: no processor
        tokenizer = copy.copy(tokenizer)
        del tokenizer.ftcore_processor
    return SimpleNamespace(model=model, tokenizer=tokenizer, template=template or native(), data=data,
                           reporter=Reporter(), phase="after", run=SimpleNamespace(is_main=True), output_dir=tmp_path)


def dataset(items: list[dict]):
    import datasets

    return datasets.Dataset.from_list(items)


def plain_answer(messages: list[dict], images: list[str], max_new_tokens: int) -> str:
    """Plain transformers: the processor's chat template on content parts, the processor, greedy generate."""
    import torch
    from PIL import Image

    model, processor = built("llava")
    parts = []
    for m in messages:
        pieces = m["content"].split("<image>")
        content = [p for k, piece in enumerate(pieces)
                   for p in ([{"type": "image"}] if k else []) + ([{"type": "text", "text": piece}] if piece else [])]
        parts.append({"role": m["role"], "content": content})
    text = processor.apply_chat_template(parts, add_generation_prompt=True)
    kwargs = {"images": [[Image.open(p).convert("RGB") for p in images]]} if images else {}
    inputs = processor(text=[text], add_special_tokens=False, return_tensors="pt", **kwargs)
    tokenizer = processor.tokenizer
    stops = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|eot_id|>")]
    with torch.no_grad():
        out = model.eval().generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stops,
                                    pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def test_generation_on_image_rows_answers_as_plain_transformers(tmp_path):
    """Batched (left-padded, images and a text row in one batch) answers equal plain transformers' one by one;
    predictions.jsonl names each row's images."""
    from ftcore_plugins.evaluators.generation import Generation

    items = rows(tmp_path)
    evaluator = Generation(Generation.Options(metrics=["exact_match"], bootstrap=0, max_new_tokens=5, batch_size=3))
    report = evaluator.evaluate(context(tmp_path, dataset(items)))
    assert report["n"] == 4
    written = [json.loads(line) for line in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    expected = [plain_answer(r["messages"][:-1], r["images"], 5) for r in items]
    assert [w["prediction"] for w in written] == expected
    assert [w.get("images", []) for w in written] == [r["images"] for r in items]
    assert report["exact_match"] == sum(p == r["messages"][-1]["content"] for p, r in zip(expected, items)) / 4


def test_perplexity_on_image_rows_is_the_models_own_loss(tmp_path):
    """exp(total NLL / labelled tokens), where each row's NLL is the model's own mean loss on its labels
    (transformers' loss, batch of one) times their count; prompt tokens leave out every image token."""
    import torch

    from ftcore_plugins.common.vision import VisionEncoder
    from ftcore_plugins.evaluators.perplexity import Perplexity

    items = rows(tmp_path)
    ctx = context(tmp_path, dataset(items))
    got = Perplexity(Perplexity.Options(batch_size=3, by_part=True)).measure(ctx, ctx.data, ctx.model, "perplexity")
    model, processor = built("llava")
    encoder = VisionEncoder(processor, native())
    nll = tokens = prompt_tokens = 0
    image = processor.tokenizer.convert_tokens_to_ids("<image>")
    for k, row in enumerate(items):
        batch = encoder([row], [k])
        with torch.no_grad():
            loss = model.eval()(**batch).loss.item()
        n = int((batch["labels"][0, 1:] != -100).sum())
        nll, tokens = nll + loss * n, tokens + n
        prompt_tokens += int(batch["attention_mask"][0].sum()) - 1 - n - int((batch["input_ids"][0] == image).sum())
    assert got["tokens"] == tokens and got["prompt/tokens"] == prompt_tokens
    assert got["perplexity"] == pytest.approx(math.exp(nll / tokens), rel=1e-5)


@pytest.mark.parametrize("evaluator", ["generation", "exact_match", "perplexity"])
def test_what_an_evaluator_cannot_do_with_image_rows_is_one_line(tmp_path, evaluator):
    from ftcore.errors import FtcoreError
    from ftcore_plugins.evaluators.exact_match import ExactMatch
    from ftcore_plugins.evaluators.generation import Generation
    from ftcore_plugins.evaluators.perplexity import Perplexity
    from ftcore_plugins.templates.chatml import ChatMLTemplate

    cls = {"generation": Generation, "exact_match": ExactMatch, "perplexity": Perplexity}[evaluator]
    data = dataset(rows(tmp_path))

    def refusal(ctx) -> str:
        with pytest.raises(FtcoreError) as info:
            if evaluator == "perplexity":
                cls(cls.Options()).measure(ctx, ctx.data, ctx.model, evaluator)
            else:
                cls(cls.Options()).evaluate(ctx)
        assert "\n" not in str(info.value)
        return str(info.value)

    assert refusal(context(tmp_path, data, processor=False)) == \
        f"evaluator '{evaluator}': the rows hold images, but the model is a text model (its loader gave no " \
        "processor); images need a vision-language model (docs/vision.md)"
    assert refusal(context(tmp_path, data, template=ChatMLTemplate(ChatMLTemplate.Options()))).startswith(
        f"evaluator '{evaluator}': template 'chatml' renders text only, and these rows hold images; use [template] "
        "use = \"native\"")


def test_the_vision_example_shortened_end_to_end(tmp_path):
    """examples/vision as a user runs it, cut to 12 steps: the tokenizer trained on the rows, the tiny
    LLaVA built around it, exact match and perplexity before and after on the held-out pictures, and a
    merged export that plain transformers loads and generates from (the full run's numbers: README)."""
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    example = tmp_path / "vision"
    shutil.copytree(ROOT / "examples" / "vision", example, ignore=shutil.ignore_patterns("runs"))
    plan = example / "plan.toml"
    plan.write_text(plan.read_text().replace("epochs = ", "max_steps = 12\n# epochs = ")
                    .replace("logging_steps = 10", "logging_steps = 1"))
    done = run_cli("run", str(plan), cwd=tmp_path, env={"OMP_NUM_THREADS": "1"}, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    run = example / "runs" / "vision"
    # The image stage's data report, as a text stage's: data_report.json and the console's table; its line
    # about the image rows once, in the log too (the data is prepared before the model loads, and again).
    report = json.loads((run / "data_report.json").read_text())["sft/train"]
    assert report["rows"] == report["images"] == report["kept"] == 480 and report["truncated"] == 0, report
    assert 0 < report["label_tokens"] < report["tokens"] and report["length_p50"] <= report["length_max"] <= 128
    assert "data for stage sft" in done.stdout, done.stdout
    assert done.stdout.count("480 rows with images") == 1
    assert (run / "run.log").read_text().count("480 rows with images") == 1
    assert "warning" not in done.stderr, done.stderr
    evals = json.loads((run / "summary.json").read_text())["evaluations"]
    before, after = (evals[phase]["perplexity"] for phase in ("before", "after"))
    assert before["tokens"] == after["tokens"] == 192  # each held-out answer and its end of turn
    assert after["perplexity"] < before["perplexity"] / 2, evals
    assert {phase: evals[phase]["exact_match"]["n"] for phase in evals} == {"before": 96, "after": 96}
    losses = [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert losses and losses[-1] < losses[0], losses
    predictions = [json.loads(line) for line in
                   (run / "evaluations" / "after" / "exact_match" / "predictions.jsonl").read_text().splitlines()]
    assert len(predictions) == 96 and all(len(p["images"]) == 1 for p in predictions), evals
    merged = run / "exports" / "merged"
    model = AutoModelForImageTextToText.from_pretrained(merged).eval()
    processor = AutoProcessor.from_pretrained(merged)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the shape?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    image = Image.open(example / "data" / "images" / "eval_0000.png").convert("RGB")
    inputs = processor(text=[text], images=[[image]], add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert out.shape[1] > inputs["input_ids"].shape[1]


# -- a plugin's evaluator on image rows --------------------------------------------------------------------

EXAMPLE_EVALUATOR = ROOT / "examples" / "ftcore-example-evaluator"


class TextAlone(Component):
    """An evaluator written before images: it declares nothing about them (it counts its rows)."""

    name = "text-alone"

    def evaluate(self, ctx):
        return {"n": len(ctx.data)}


class TextAlonePlugin:
    @ftcore.hookimpl
    def register_evaluators(self, register):
        register(TextAlone)


def test_the_example_evaluator_answers_image_rows_from_their_pictures(tmp_path, monkeypatch, capsys):
    """examples/ftcore-example-evaluator's answer_length (supports_images) on examples/vision, trained 6 epochs:
    each held-out question is answered with its picture. Every colour question has the same text (so has every
    shape question), so answers from the text alone could be right at most 12 + 16 times of 96 (each colour
    answers 12 of them, each shape 16): the control, the same questions without their pictures, is held to
    that, and the answers with the pictures are right far more often. Its answers stop where the built-ins'
    stop (the template's end of turn, through the documented stop_token_ids). An evaluator that declares nothing
    gets the rows with images too, and one warning."""
    import importlib

    from rich.console import Console

    from ftcore.plan import load_plan
    from ftcore.plugins import PluginInfo, get_plugin_manager
    from ftcore.runner import Runner

    monkeypatch.syspath_prepend(str(EXAMPLE_EVALUATOR))
    example = importlib.import_module("ftcore_example_evaluator")
    assert example.AnswerLength.supports_images is True
    pm = get_plugin_manager(entry_points=False)
    pm.add_plugin(example, PluginInfo("example-evaluator", "ftcore-example-evaluator", "0.1.0", "entry point"))
    pm.add_plugin(TextAlonePlugin(), PluginInfo("text-alone", "text-alone-dist", "1.0", "entry point"))
    pm.check_pending()

    data = ROOT / "examples" / "vision" / "data"
    rows = [json.loads(line) for line in (data / "eval.jsonl").read_text().splitlines()]
    blind = tmp_path / "blind.jsonl"
    blind.write_text("".join(json.dumps({"messages": [{**m, "content": m["content"].replace("<image>", "")}
                                                      for m in r["messages"]]}) + "\n" for r in rows))
    text = (ROOT / "examples" / "vision" / "plan.toml").read_text().split("[[evaluate]]")[0]
    assert "epochs = 30" in text and 'path = "data/' in text
    evaluations = "".join(f'\n[[evaluate]]\nname = "{name}"\nuse = "answer_length"\ndata = "{ref}"\nwhen = "after"\n'
                          "max_new_tokens = 4\n" for name, ref in (("pictures", "eval"), ("blind", "blind")))
    plan = tmp_path / "plan.toml"
    plan.write_text(text.replace("epochs = 30", "epochs = 6").replace('path = "data/', f'path = "{data.as_posix()}/')
                    + f'\n[data.blind]\nuse = "jsonl"\npath = "{blind.as_posix()}"\n' + evaluations
                    + '\n[[evaluate]]\nuse = "text-alone"\ndata = "eval"\n')
    with open(tmp_path / "out.txt", "w") as out:
        Runner(load_plan(plan, pm.registry()), pm, Console(file=out, width=120)).run()
    warned = [line for line in capsys.readouterr().err.splitlines() if "supports_images" in line]

    after = tmp_path / "runs" / "vision" / "evaluations" / "after"
    answers = {name: [json.loads(line) for line in (after / name / "answers.jsonl").read_text().splitlines()]
               for name in ("pictures", "blind")}
    assert [a["images"] for a in answers["pictures"]] == [[str(data / ref) for ref in r["images"]] for r in rows]
    assert all("images" not in a for a in answers["blind"])
    right = {name: sum(a["answer"] == a["reference"] for a in found) for name, found in answers.items()}
    assert right["blind"] <= 12 + 16, right
    assert right["pictures"] >= 60, right
    # It stops where the built-ins stop: the native template declares no stop token, and the model ends each
    # answer with its end of turn (<|eot_id|>), not with the tokenizer's EOS.
    assert sum(a["stopped"] for a in answers["pictures"]) >= 90, answers["pictures"][:3]
    assert warned == ["warning: evaluation 'text-alone': data 'eval' holds rows with images, and evaluator "
                      "'text-alone' from plugin 'text-alone' (text-alone-dist 1.0) does not declare that it reads "
                      "them (supports_images): it may use their text alone (docs/writing-plugins.md)"], warned
