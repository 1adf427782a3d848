"""The ``target_length`` reward function: how close a completion's length is to a target.

A reward function is a component with ``score(prompts, completions) -> list[float]``: one float per
completion, higher is better. ``grpo``, ``rloo`` and ``ppo`` call it on every batch of sampled
completions (decoded text, without the prompt). Keep it cheap and free of heavy imports.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field

import ftcore
from ftcore.component import Component, Options


class TargetLength(Component):
    """1.0 for a completion of exactly ``target`` words (or characters), falling linearly to 0.0 at
    twice the target or at nothing."""

    name = "target_length"

    class Options(Options):
        target: int = Field(ge=1)  # required
        unit: Literal["words", "characters"] = "words"

    def score(self, prompts: list[str], completions: list[str]) -> list[float]:
        o = self.options
        sizes = [len(re.findall(r"\S+", c)) if o.unit == "words" else len(c.strip()) for c in completions]
        return [max(0.0, 1.0 - abs(n - o.target) / o.target) for n in sizes]


@ftcore.hookimpl
def register_reward_functions(register):
    register(TargetLength)
