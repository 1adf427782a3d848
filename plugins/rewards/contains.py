"""Reward function ``contains``: rewards completions that contain given words or phrases."""

from __future__ import annotations

import re

from pydantic import Field

import ftcore
from ftcore.component import Component, Options


class Contains(Component):
    """1.0 for a completion that contains one of the words (or all of them), else 0.0."""

    name = "contains"

    class Options(Options):
        words: list[str] = Field(min_length=1)
        all: bool = False  # require every word, not just one
        case_sensitive: bool = False
        whole_words: bool = True  # "horse" does not match "horses"
        partial: bool = False  # with all = true: the share of the words present, not 0 or 1

    def __init__(self, options=None):
        super().__init__(options)
        o = self.options
        flags = 0 if o.case_sensitive else re.IGNORECASE
        self._patterns = [re.compile(rf"\b{re.escape(w)}\b" if o.whole_words else re.escape(w), flags)
                          for w in o.words]

    def score(self, prompts: list[str], completions: list[str]) -> list[float]:
        out = []
        for text in completions:
            hits = sum(1 for p in self._patterns if p.search(text))
            if not self.options.all:
                out.append(1.0 if hits else 0.0)
            elif self.options.partial:
                out.append(hits / len(self._patterns))
            else:
                out.append(1.0 if hits == len(self._patterns) else 0.0)
        return out


@ftcore.hookimpl
def register_reward_functions(register):
    register(Contains)
