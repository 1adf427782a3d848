"""Reward function ``regex``: rewards completions that match a regular expression."""

from __future__ import annotations

import re

from pydantic import field_validator

import ftcore
from ftcore.component import Component, Options


class Regex(Component):
    """1.0 (match) or 0.0 (miss) by whether the completion matches a regular expression."""

    name = "regex"

    class Options(Options):
        pattern: str
        full: bool = False
        match: float = 1.0
        miss: float = 0.0

        @field_validator("pattern")
        @classmethod
        def _compiles(cls, value: str) -> str:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"not a valid regular expression: {exc}") from None
            return value

    def score(self, prompts: list[str], completions: list[str]) -> list[float]:
        o = self.options
        pattern = re.compile(o.pattern)
        find = pattern.fullmatch if o.full else pattern.search
        return [o.match if find(text.strip() if o.full else text) else o.miss for text in completions]


@ftcore.hookimpl
def register_reward_functions(register):
    register(Regex)
