"""``ftcore chat``: talk to a run's model in the terminal, rendered with the run's own chat template."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

import ftcore
from ftcore.command import Command
from ftcore.errors import FtcoreError

HELP = """\
/reset                 forget the conversation (the system prompt stays)
/system TEXT           set the system prompt (/system alone removes it); the conversation restarts
/set KEY=VALUE ...     change decoding: temperature (0 = greedy), top_p, max_new_tokens, seed
/help                  this list
/exit                  quit (also Ctrl-D); Ctrl-C stops an answer, or quits at the prompt"""

SETTINGS = {"temperature": float, "top_p": float, "max_new_tokens": int, "seed": int}


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

    def __init__(self, models: list[Any], sampling: Any, system: str | None, console: Any):
        self.models, self.sampling, self.system, self.console = models, sampling, system, console
        self.histories: list[list[dict]] = [[] for _ in models]

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
            self.histories = [[] for _ in self.models]
            say("[dim](conversation cleared)[/]")
        elif name == "/system":
            self.system = rest or None
            self.histories = [[] for _ in self.models]
            say("[dim](system prompt " + ("set" if self.system else "removed") + "; conversation cleared)[/]")
        elif name == "/set":
            try:
                self.sampling = parse_settings(rest.split(), self.sampling)
            except ValueError as exc:
                say(f"[red]{exc}[/]", highlight=False)
            else:
                say(f"[dim]({self.sampling.describe()})[/]", highlight=False)
        else:
            say(f"[red]unknown command {name}[/]; /help lists them", highlight=False)
        return None

    def answer_all(self, text: str) -> None:
        for model, history in zip(self.models, self.histories):
            if len(self.models) > 1:
                self.console.print(f"[bold cyan]{model.label}:[/]", highlight=False)
            turn = [{"role": "user", "content": text}]
            system = [{"role": "system", "content": self.system}] if self.system else []
            try:
                answer = self.stream(model, model.render(system + history + turn))
            except KeyboardInterrupt:
                print("\n(stopped; this turn is forgotten)", flush=True)
                return
            except Exception as exc:  # noqa: BLE001 - a template or model error ends the turn, not the chat
                print(flush=True)
                self.console.print(f"[red]error:[/] {type(exc).__name__}: {exc}", highlight=False)
                return
            history += [*turn, {"role": "assistant", "content": answer}]

    def stream(self, model: Any, prompt: str) -> str:
        """Print the answer as plain text while it is generated; return it stripped."""
        pieces: list[str] = []
        started = False
        for piece in model.stream(prompt, self.sampling):
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
        add_sampling_arguments(parser)

    def run(self, args: argparse.Namespace) -> int:
        try:
            return self._run(args)
        except KeyboardInterrupt:  # while loading
            print("\ninterrupted", file=sys.stderr)
            return 130

    def _run(self, args: argparse.Namespace) -> int:
        from rich.console import Console

        from ftcore_plugins.common.run_model import Run

        try:
            import readline  # noqa: F401 - line editing and history for input()
        except ImportError:
            pass
        sampling = sampling_from(args)
        console, notes = Console(soft_wrap=True), Console(stderr=True, soft_wrap=True)
        run = Run(args.run_dir, notes)
        if args.compare is not None:
            run.check_stage(args.compare)  # before loading anything
        model = run.model(stage=args.stage, export=args.export)
        models = [model]
        if args.compare is not None:
            other = run.model(stage=args.compare)
            if other.label == model.label:
                raise FtcoreError(f"--compare {args.compare}: that is the model you chat with already")
            models = [other, model]
        names = " and ".join(m.label for m in models)
        console.print(f"[bold]ftcore chat[/]: {run.shown}: {names}; template '{run.plan.template.name}'; "
                      f"{sampling.describe()}. /help for commands, Ctrl-D to quit.", highlight=False)
        return Chat(models, sampling, args.system, console).loop()


@ftcore.hookimpl
def register_commands(register):
    register(ChatCommand)
