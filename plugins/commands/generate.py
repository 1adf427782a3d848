"""``ftcore generate``: answers from a run's model to a JSONL file of prompts, in batches."""

from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ftcore
from ftcore.command import Command
from ftcore.errors import FtcoreError

from ftcore_plugins.commands.chat import (add_model_arguments, add_sampling_arguments, capped, context_length,
                                          quiet_libraries, sampling_from)

ACCEPTED = ("prompt (a string or a list of messages), messages, conversations (ShareGPT), "
            "or instruction/output (Alpaca)")


@dataclass
class InputRow:
    line: int
    prompt: str | list[dict]  # messages, or text used as it is (--raw)
    reference: str | None
    id: Any = None
    images: list[str] | None = None  # image references (absolute paths, data: URLs), one per <image>, in order


def read_inputs(path: Path, shown: str, raw: bool) -> list[InputRow]:
    """The rows of a JSONL file of prompts; a bad row is one error naming the file and its line.

    A string ``prompt`` is one user turn (with ``raw``, text given to the model as it is, as the
    ``generation`` evaluator treats prompt/completion rows); chat rows in any format the data sources
    read (OpenAI messages, ShareGPT, Alpaca) end with the prompt, or with a reference answer that is left
    out of the prompt and written beside the model's answer, as the evaluator does; ``completion`` is a
    string prompt's reference.

    A row may hold images as training rows do (docs/vision.md): image content parts, or an ``images`` list
    with ``<image>`` placeholders (none: before the first user turn's text), paths relative to the input
    file's folder. Each image is checked (it exists and decodes) here, before any model loads."""
    from ftcore_plugins.common.formats import RowError, convert

    if not path.is_file():
        raise FtcoreError(f"{shown}: no such input file")
    base = str(path.resolve().parent)
    rows: list[InputRow] = []
    with path.open(encoding="utf-8") as fh:
        for number, text in enumerate(fh, 1):
            if not text.strip():
                continue
            where = f"{shown}:{number}"
            try:
                row = json.loads(text.rstrip("\r\n"))
            except json.JSONDecodeError as exc:
                raise FtcoreError(f"{where}: not valid JSON: {exc.msg} (column {exc.colno})") from None
            if not isinstance(row, dict):
                raise FtcoreError(f"{where}: expected an object with {ACCEPTED}; got {type(row).__name__}")
            reference = row.get("completion")
            if reference is not None and not isinstance(reference, str):
                raise FtcoreError(f"{where}: 'completion' (the reference answer) must be a string")
            prompt: Any = row.get("prompt")
            given = {"images": row["images"]} if "images" in row else {}
            images = None
            try:
                if isinstance(prompt, str):
                    if not prompt.strip():
                        raise RowError("'prompt' is empty")
                    if raw and given:
                        raise RowError("a --raw prompt is given to the model as it is, without the chat template, "
                                       "so it cannot hold images; give it without --raw")
                    if not raw:
                        prompt = [{"role": "user", "content": prompt}]
                    if given:  # {"prompt": "...", "images": [...]}: the user turn with its images
                        _, _, converted = convert({"messages": prompt, **given}, "messages", base=base)
                        prompt, images = converted["messages"], converted.get("images")
                elif prompt is not None:
                    _, _, converted = convert({"messages": prompt, **given}, "messages", base=base)
                    prompt, images = converted["messages"], converted.get("images")
                else:
                    if not any(k in row for k in ("messages", "conversations", "instruction")):
                        raise RowError(f"no prompt: give {ACCEPTED} (the row has: {', '.join(row) or 'nothing'})")
                    _, kind, converted = convert(row, base=base)
                    images = converted.get("images")
                    if kind != "chat":
                        raise RowError(f"a {kind} row; give {ACCEPTED}")
                    prompt = converted["messages"]
                    if prompt[-1]["role"] == "assistant":
                        reference = prompt[-1]["content"]
                        prompt = prompt[:-1]
                    if not prompt:
                        raise RowError("the conversation has only an answer, no prompt before it")
            except RowError as exc:
                raise FtcoreError(f"{where}: {exc}") from None
            rows.append(InputRow(number, prompt, reference, row.get("id"), images))
    if not rows:
        raise FtcoreError(f"{shown}: no rows")
    return rows


def text_model(plan: Any) -> bool:
    """Whether the plan's model is known to be a text model without loading it: a ``scratch`` text
    architecture, or a local folder whose config.json has no vision tower (a hub id: not known yet)."""
    from ftcore_plugins.common.vlm import plan_vision_model

    if plan_vision_model(plan) is not None:
        return False
    if plan.model.name == "scratch":
        return True
    path = getattr(plan.model.options, "path", None)
    return path is not None and (Path(str(path)) / "config.json").is_file()


def images_refused(shown: str, row: InputRow, run: str, what: str) -> str:
    return (f"{shown}:{row.line}: this row holds {len(row.images or [])} image(s), and {run}'s model is {what}, "
            "which reads text only; images need a vision-language model's run (docs/vision.md)")


def counted(n: int, noun: str) -> str:
    """``1 row``, ``2 rows``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def normalize(text: str) -> str:
    """The ``exact_match`` evaluator's comparison: case and runs of whitespace ignored."""
    return re.sub(r"\s+", " ", text).strip().lower()


class GenerateCommand(Command):
    """Answer a JSONL file of prompts with a run's model, in batches.

    Each input row ({"prompt": "..."} or {"messages": [...]}, ...) is rendered with the run's chat
    template and answered; the output has one JSON line per row, in input order: the prompt as the
    model saw it, the answer, and the reference when the row ends with an assistant answer or has a
    "completion". Greedy unless --temperature > 0. See docs/chat.md.
    """

    name = "generate"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_model_arguments(parser)
        parser.add_argument("--input", required=True, metavar="FILE", help="prompts, one JSON object a line")
        parser.add_argument("--output", required=True, metavar="FILE", help="answers, one JSON object a line")
        parser.add_argument("--force", action="store_true", help="overwrite --output if it exists")
        parser.add_argument("--raw", action="store_true",
                            help="give string prompts to the model as they are, without the chat template (for "
                                 "runs trained on plain prompt/completion text)")
        add_sampling_arguments(parser)
        parser.add_argument("--batch-size", type=int, default=16, help="prompts per batch (default 16)")

    def run(self, args: argparse.Namespace) -> int:
        if not args.debug:  # the libraries' chatter off, as ftcore chat keeps it (their errors still show)
            quiet_libraries()
        from rich.console import Console

        from ftcore.reporter import Reporter

        from ftcore_plugins.common.run_model import Run

        sampling = sampling_from(args)
        if args.batch_size < 1:
            raise FtcoreError(f"--batch-size must be >= 1, got {args.batch_size}")
        output = Path(args.output)
        if output.exists() and not args.force:
            raise FtcoreError(f"{args.output} already exists; pass --force to overwrite it, or choose another "
                              "--output")
        rows = read_inputs(Path(args.input), args.input, args.raw)  # bad input fails before the model loads
        console = Console(stderr=True, soft_wrap=True)
        run = Run(args.run_dir, console)
        with_images = next((r for r in rows if r.images), None)
        if with_images is not None and args.export is None and text_model(run.plan):  # known without loading
            raise FtcoreError(images_refused(args.input, with_images, run.shown, "a text model"))
        model = run.model(stage=args.stage, export=args.export)
        if with_images is not None and not model.vision:
            raise FtcoreError(images_refused(args.input, with_images, run.shown, f"a text model ({model.label})"))
        # As ftcore chat: no answer is longer than the model's context; a longer --max-new-tokens is capped, saying so.
        sampling = capped(sampling, context_length(model), lambda note: console.print(note, highlight=False))
        prompts = []
        for row in rows:
            try:
                prompts.append(model.render(row.prompt) if isinstance(row.prompt, list) else row.prompt)
            except FtcoreError:
                raise
            except Exception as exc:  # noqa: BLE001 - a template that refuses a conversation (roles, order)
                raise FtcoreError(f"{args.input}:{row.line}: template '{run.plan.template.name}' cannot render "
                                  f"this conversation: {type(exc).__name__}: {exc}") from None
        with Reporter(console, None, None, None).progress(f"generate ({model.label})", len(prompts)) as bar:
            images = [r.images or [] for r in rows] if with_images is not None else None
            answers = model.answers(prompts, sampling, args.batch_size, bar, images)

        tmp = output.with_name(output.name + ".tmp")
        output.parent.mkdir(parents=True, exist_ok=True)
        with tmp.open("w", encoding="utf-8") as fh:
            for row, prompt, answer in zip(rows, prompts, answers):
                record: dict[str, Any] = {} if row.id is None else {"id": row.id}
                record["prompt"] = prompt
                if row.images:
                    record["images"] = row.images
                record["answer"] = answer
                if row.reference is not None:
                    record["reference"] = row.reference
                fh.write(json.dumps(record, ensure_ascii=False) + "\n")
        os.replace(tmp, output)

        scored = [(a, r.reference) for r, a in zip(rows, answers) if r.reference is not None]
        note = ""
        if scored:
            exact = sum(a.strip() == r.strip() for a, r in scored) / len(scored)
            loose = sum(normalize(a) == normalize(r) for a, r in scored) / len(scored)
            note = (f"; {counted(len(scored), 'row')} {'has' if len(scored) == 1 else 'have'} a reference: exact "
                    f"match {exact:.4f} (as the generation evaluator), {loose:.4f} ignoring case and spaces (as "
                    "exact_match)")
        console.print(f"wrote {counted(len(answers), 'answer')} to {args.output} ({model.label}, "
                      f"{sampling.describe()}){note}", highlight=False)
        return 0


@ftcore.hookimpl
def register_commands(register):
    register(GenerateCommand)
