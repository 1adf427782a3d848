"""User-facing errors. Each one renders as a single actionable line."""

from __future__ import annotations

import difflib
import sys
from collections.abc import Iterable


class FtcoreError(Exception):
    """An error the user can fix (plan, data, plugin). The CLI prints it in one line and exits 2."""

    exit_code = 2


class PlanError(FtcoreError):
    """One or more problems in a plan. ``problems`` holds one line each."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class Interrupted(KeyboardInterrupt):
    """The run stopped on a signal, cleanly (a stage saved a checkpoint). ``message`` says where and how
    to resume; the CLI prints it and exits with ``exit_code`` (128 + the signal number)."""

    def __init__(self, message: str, exit_code: int = 130):
        super().__init__(message)
        self.message, self.exit_code = message, exit_code


class ComponentError(Exception):
    """A component raised while running. Not the user's input; exits 1."""

    exit_code = 1


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """Return ``"; did you mean 'x'?"`` for the closest choice, or an empty string."""
    choices = sorted(set(choices))
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def unknown_choice(what: str, word: str, choices: Iterable[str], none: str = "none installed") -> str:
    """``unknown trainer 'sfft'; did you mean 'sft'? Available: pretrain, sft``"""
    choices = sorted(set(choices))
    available = ", ".join(choices) if choices else none
    hint = did_you_mean(word, choices)
    return f"unknown {what} {word!r}{hint} {'Available' if hint else '; available'}: {available}".replace(" ;", ";")


def one_line(exc: BaseException) -> str:
    """``ValueError: <the message's first line>``: an exception as one line of a report."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


_warned: set[str] = set()


def warn(problem: str) -> None:
    """Print a warning once per process, however many plugin managers or registries meet it."""
    if problem not in _warned:
        _warned.add(problem)
        print(f"warning: {problem}", file=sys.stderr)
