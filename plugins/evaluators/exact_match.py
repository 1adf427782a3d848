"""Evaluator ``exact_match``: the ``generation`` evaluator reduced to greedy answers and exact match,
kept for the plans that use it."""

from __future__ import annotations

import re

from pydantic import Field

import ftcore
from ftcore.component import Options
from ftcore.types import Tokens

from ftcore_plugins.evaluators.generation import Generation, row_metrics


def normalize(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


class ExactMatch(Generation):
    """Share of held-out chat prompts whose greedy answer equals the reference (last assistant turn)."""

    name = "exact_match"

    class Options(Options):
        max_new_tokens: Tokens = 32
        batch_size: int = Field(16, ge=1, le=1 << 16)
        normalize: bool = True  # compare case- and whitespace-insensitively
        limit: int | None = Field(None, ge=1)  # score at most this many rows

    def check(self, plan) -> list[str]:
        return []

    def sampling(self) -> dict:
        return {"do_sample": False}

    def score(self, predictions: list[str], references: list[str], reporter=None) -> tuple[dict[str, list[float]],
                                                                                         dict]:
        if self.options.normalize:
            per_row = {"exact_match": [float(normalize(p) == normalize(r)) for p, r in zip(predictions, references)]}
        else:
            per_row = row_metrics(predictions, references, ["exact_match"])
        return per_row, {"exact_match": sum(per_row["exact_match"]) / len(predictions)}


@ftcore.hookimpl
def register_evaluators(register):
    register(ExactMatch)
