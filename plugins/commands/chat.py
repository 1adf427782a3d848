"""``ftcore chat``: talk to a run's model in the terminal, rendered with the run's own chat template."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import warnings
from typing import Any

import ftcore
from ftcore.command import Command
from ftcore.errors import FtcoreError

HELP = """\
/reset                 forget the conversation (the system prompt stays)
/system TEXT           set the system prompt (/system alone removes it); the conversation restarts
/set KEY=VALUE ...     change decoding: temperature (0 = greedy), top_p, max_new_tokens, seed
/image PATH            attach an image to your next message (a vision-language model's run)
/help                  this list
/exit                  quit (also Ctrl-D); Ctrl-C stops an answer, or quits at the prompt"""

SETTINGS = {"temperature": float, "top_p": float, "max_new_tokens": int, "seed": int}

# Libraries whose loggers chatter while the model loads: bitsandbytes' CPU backend, imported by peft,
# warns at import that it cannot load an optional kernel ("Failed to load CPU gemm_4bit_forward from
# kernels-community: No module named 'kernels'"); transformers draws a progress bar per model it loads.
NOISY = ("bitsandbytes", "transformers", "peft", "accelerate", "torch", "huggingface_hub", "trl", "datasets")


def quiet_libraries() -> None:
    """Third-party libraries' import- and load-time chatter off (their errors still show): their loggers
    below ERROR, transformers' and huggingface_hub's progress bars, and FutureWarnings and
    DeprecationWarnings (transformers' own deprecations, seen when a peft model loads). ftcore's notes stay."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for name in NOISY:
        logging.getLogger(name).setLevel(logging.ERROR)
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category)
    if "transformers" in sys.modules:  # imported already: its own switches (the variables above work at import)
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity_error()
        transformers_logging.disable_progress_bar()


def context_length(model: Any) -> int | None:
    """The longest sequence the model takes (prompt and answer), or None when it does not say."""
    llm = getattr(model, "llm", None)
    if llm is not None:
        return int(llm.n_ctx())
    config = getattr(getattr(model, "model", None), "config", None)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def capped(sampling: Any, context: int | None, say: Any, where: str = "--max-new-tokens") -> Any:
    """``sampling`` with max_new_tokens at most the model's context, saying so when it was beyond it."""
    if context is None or sampling.max_new_tokens <= context:
        return sampling
    say(f"({where} {sampling.max_new_tokens} is beyond the model's context of {context} tokens: capped at {context})")
    return dataclasses.replace(sampling, max_new_tokens=context)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """RUN_DIR and which of its models to use: the final one, a stage's or an export's."""
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory, e.g. runs/<name>")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--stage", metavar="NAME",
                       help="the model as it was after this stage (from RUN_DIR/stages/NAME/), or 'base' for the "
                            "model before training; default: the run's final model")
    which.add_argument("--export", metavar="NAME",
                       help="an export of the run instead: merged, adapter or gguf (an [[export]] name; a GGUF file "
                            "needs llama-cpp-python)")


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default) decodes greedily")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling when temperature > 0")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="longest answer, in tokens (default 256)")
    parser.add_argument("--seed", type=int, default=None, help="random seed for sampling")


def sampling_from(args: argparse.Namespace) -> Any:
    from ftcore_plugins.common.run_model import Sampling

    sampling = Sampling(args.temperature, args.top_p, args.max_new_tokens, args.seed)
    problem = sampling.check()
    if problem:
        raise FtcoreError(problem.replace("temperature", "--temperature", 1).replace("top_p", "--top-p", 1)
                          .replace("max_new_tokens", "--max-new-tokens", 1))
    return sampling


def image_reference(path: str) -> str:
    """An image path as given (relative to the current folder) -> its checked reference (it exists and
    decodes); :class:`~ftcore_plugins.common.images.ImageError` (one line naming it) if not."""
    from ftcore_plugins.common.images import check_image, reference

    ref = reference(path, os.getcwd())
    check_image(ref)
    return ref


def parse_settings(words: list[str], sampling: Any) -> Any:
    """``/set temperature=0.7 top_p=0.9``: new settings, or ValueError saying what is wrong."""
    if not words:
        raise ValueError(f"usage: /set KEY=VALUE ...; keys: {', '.join(SETTINGS)}")
    changes: dict[str, Any] = {}
    for word in words:
        key, eq, value = word.partition("=")
        if not eq or key not in SETTINGS:
            raise ValueError(f"unknown setting {word!r}; settings: {', '.join(f'{k}=...' for k in SETTINGS)}")
        try:
            changes[key] = SETTINGS[key](value)
        except ValueError:
            raise ValueError(f"{key}: expected {SETTINGS[key].__name__}, got {value!r}") from None
    new = dataclasses.replace(sampling, **changes)
    problem = new.check()
    if problem:
        raise ValueError(problem)
    return new


class Chat:
    """The conversation loop: one history per model, so each model sees its own earlier answers."""

    def __init__(self, models: list[Any], sampling: Any, system: str | None, console: Any,
                 images: list[str] | None = None):
        self.models, self.sampling, self.system, self.console = models, sampling, system, console
        self.histories: list[list[dict]] = [[] for _ in models]
        # Each history's images (references), one per <image> placeholder in its messages, in order; and
        # the images attached to the next message (--image, /image).
        self.images: list[list[str]] = [[] for _ in models]
        self.pending: list[str] = list(images or [])
        known = [c for c in (context_length(m) for m in models) if c is not None]
        self.context = min(known) if known else None

    def loop(self) -> int:
        while True:
            try:
                line = input("you> ")
            except EOFError:  # Ctrl-D
                print()
                return 0
            except KeyboardInterrupt:  # Ctrl-C at the prompt
                print()
                return 130
            text = line.strip()
            if not text:
                continue
            if text.startswith("/"):
                if self.command(text) == "exit":
                    return 0
                continue
            self.answer_all(text)

    def command(self, text: str) -> str | None:
        name, _, rest = text.partition(" ")
        rest = rest.strip()
        say = self.console.print
        if name in ("/exit", "/quit"):
            return "exit"
        if name == "/help":
            say(HELP, highlight=False, markup=False)
        elif name == "/reset":
            self.histories, self.images = [[] for _ in self.models], [[] for _ in self.models]
            say("[dim](conversation cleared)[/]")
        elif name == "/system":
            self.system = rest or None
            self.histories, self.images = [[] for _ in self.models], [[] for _ in self.models]
            say("[dim](system prompt " + ("set" if self.system else "removed") + "; conversation cleared)[/]")
        elif name == "/image":
            self.attach(rest)
        elif name == "/set":
            try:
                self.sampling = capped(parse_settings(rest.split(), self.sampling), self.context,
                                       lambda note: say(note, style="dim", highlight=False), "max_new_tokens")
            except ValueError as exc:
                say(f"[red]{exc}[/]", highlight=False)
            else:
                say(f"[dim]({self.sampling.describe()})[/]", highlight=False)
        else:
            say(f"[red]unknown command {name}[/]; /help lists them", highlight=False)
        return None

    def attach(self, path: str) -> None:
        """``/image PATH``: the image goes with the next message."""
        from ftcore_plugins.common.images import ImageError

        say = self.console.print
        if not path:
            say("[red]usage: /image PATH[/] (an image file, attached to your next message)", highlight=False)
            return
        text_models = [m.label for m in self.models if not m.vision]
        if text_models:
            say(f"[red]/image: {' and '.join(text_models)} is a text model and reads no images[/]", highlight=False)
            return
        try:
            ref = image_reference(path)
        except ImageError as exc:
            say(f"/image: {exc}", style="red", highlight=False, markup=False)
            return
        self.pending.append(ref)
        say(f"(image {ref} goes with your next message)", style="dim", highlight=False, markup=False)

    def answer_all(self, text: str) -> None:
        from ftcore_plugins.common.images import IMAGE

        answered = False
        for k, (model, history) in enumerate(zip(self.models, self.histories)):
            if len(self.models) > 1:
                self.console.print(f"[bold cyan]{model.label}:[/]", highlight=False)
            # Attached images go before the text of the message, as a data row's images without placeholders.
            turn = [{"role": "user", "content": IMAGE * len(self.pending) + text}]
            images = self.images[k] + self.pending
            system = [{"role": "system", "content": self.system}] if self.system else []
            try:
                prompt = model.render(system + history + turn)
                sampling = self.sampling
                context = context_length(model)
                if context is not None:  # the answer gets what the conversation leaves of the context
                    room = context - model.prompt_tokens(prompt, images)
                    if room < 1:
                        self.console.print(f"[red]the conversation fills the model's context ({context} tokens): "
                                           "/reset to start again[/]", highlight=False)
                        return
                    sampling = dataclasses.replace(sampling, max_new_tokens=min(sampling.max_new_tokens, room))
                answer = self.stream(model, prompt, sampling, images)
            except KeyboardInterrupt:
                print("\n(stopped; this turn is forgotten)", flush=True)
                return
            except Exception as exc:  # noqa: BLE001 - a template or model error ends the turn, not the chat
                print(flush=True)
                self.console.print(f"[red]error:[/] {type(exc).__name__}: {exc}", highlight=False)
                return
            history += [*turn, {"role": "assistant", "content": answer}]
            self.images[k] = images
            answered = True
        if answered:
            self.pending = []

    def stream(self, model: Any, prompt: str, sampling: Any = None, images: list[str] | None = None) -> str:
        """Print the answer as plain text while it is generated; return it stripped."""
        pieces: list[str] = []
        started = False
        for piece in model.stream(prompt, sampling or self.sampling, images or None):
            pieces.append(piece)
            if not started:  # the answer starts at its first visible character
                piece = piece.lstrip()
                started = bool(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
        print(flush=True)
        return "".join(pieces).strip()


class ChatCommand(Command):
    """Chat with a run's model in the terminal.

    The run's final model (or a stage's, or an export's) answers as it streams, rendered with the run's
    own chat template. In the chat: /reset, /system TEXT, /set temperature=0.7 top_p=0.9
    max_new_tokens=256, /help, /exit. --compare base answers each message with the model as it was before
    training too. See docs/chat.md.
    """

    name = "chat"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_model_arguments(parser)
        parser.add_argument("--compare", metavar="WHICH",
                            help="also answer every message with this model, shown first: 'base' (before "
                                 "training) or a stage's name")
        parser.add_argument("--system", metavar="TEXT", help="a system prompt to start with")
        parser.add_argument("--image", metavar="PATH", action="append", default=[],
                            help="attach this image to your first message (a vision-language model's run; "
                                 "repeat for several); in the chat, /image PATH attaches one to the next")
        add_sampling_arguments(parser)

    def run(self, args: argparse.Namespace) -> int:
        try:
            code = self._run(args)
        except KeyboardInterrupt:  # while loading
            print("\ninterrupted", file=sys.stderr)
            code = 130
        if code is not None and sys.stdin.isatty():
            # At a terminal the conversation is over and nothing is left to write: leave now. The
            # interpreter's teardown of the loaded libraries (bitsandbytes, which peft imports, most)
            # made Ctrl-D take about 3 s.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        return code

    def _run(self, args: argparse.Namespace) -> int:
        quiet_libraries()
        from rich.console import Console

        from ftcore_plugins.common.run_model import Run

        try:
            import readline  # noqa: F401 - line editing and history for input()
        except ImportError:
            pass
        from ftcore_plugins.common.images import ImageError
        from ftcore_plugins.commands.generate import text_model

        sampling = sampling_from(args)
        images = []
        for path in args.image:  # checked before anything loads
            try:
                images.append(image_reference(path))
            except ImageError as exc:
                raise FtcoreError(f"--image {path}: {exc}") from None
        console, notes = Console(soft_wrap=True), Console(stderr=True, soft_wrap=True)
        run = Run(args.run_dir, notes)
        if args.compare is not None:
            run.check_stage(args.compare)  # before loading anything
        refusal = f"--image: {run.shown}'s model is a text model, which reads no images; images need a " \
                  "vision-language model's run (docs/vision.md)"
        if images and args.export is None and text_model(run.plan):  # known without loading
            raise FtcoreError(refusal)
        model = run.model(stage=args.stage, export=args.export)
        models = [model]
        if args.compare is not None:
            other = run.model(stage=args.compare)
            if other.label == model.label:
                raise FtcoreError(f"--compare {args.compare}: that is the model you chat with already")
            models = [other, model]
        known = [c for c in (context_length(m) for m in models) if c is not None]
        sampling = capped(sampling, min(known) if known else None,
                          lambda note: notes.print(note, style="dim", highlight=False))
        if images and not all(m.vision for m in models):
            raise FtcoreError(refusal)
        names = " and ".join(m.label for m in models)
        console.print(f"[bold]ftcore chat[/]: {run.shown}: {names}; template '{run.plan.template.name}'; "
                      f"{sampling.describe()}. /help for commands, Ctrl-D to quit.", highlight=False)
        if images:
            console.print(f"({len(images)} image(s) go with your first message: {', '.join(images)})", style="dim",
                          highlight=False, markup=False)
        return Chat(models, sampling, args.system, console, images).loop()


@ftcore.hookimpl
def register_commands(register):
    register(ChatCommand)
