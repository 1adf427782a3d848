"""Shared helpers: tiny offline plans and a CLI runner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "fixtures"


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    """Tests (and the CLI runs they start) use a cache of their own, never the user's."""
    os.environ["FTCORE_CACHE_DIR"] = str(tmp_path_factory.mktemp("ftcore-cache"))
    os.environ["HF_DATASETS_CACHE"] = str(tmp_path_factory.mktemp("hf-datasets-cache"))
    yield


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: int = 600):
    """Run ``python -m ftcore ARGS`` in a subprocess, as a user would."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "ftcore", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


ANIMALS = ["cat", "dog", "bird", "fox"]
OTHERS = ["red", "blue", "tree", "stone", "runs", "sees"]


def chat_rows(n: int, seed: int = 0) -> list[dict]:
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        animal = rng.choice(ANIMALS)
        words = [animal, *rng.sample(OTHERS, 2)]
        rng.shuffle(words)
        rows.append({"messages": [{"role": "user", "content": "Which is an animal? " + " ".join(words)},
                                  {"role": "assistant", "content": f"the {animal}"}]})
    return rows


def text_rows(n: int, seed: int = 0) -> list[dict]:
    import random

    rng = random.Random(seed)
    return [{"text": " ".join(f"the {rng.choice(OTHERS)} {rng.choice(ANIMALS)} {rng.choice(OTHERS)}."
                              for _ in range(4))} for _ in range(n)]


@pytest.fixture
def tiny_project(tmp_path: Path):
    """A folder with tiny text and chat data, and a function that writes a plan there."""
    write_jsonl(tmp_path / "text.jsonl", text_rows(64))
    write_jsonl(tmp_path / "chat.jsonl", chat_rows(64))
    write_jsonl(tmp_path / "chat_eval.jsonl", chat_rows(16, seed=1))

    def plan(body: str, name: str = "plan.toml") -> Path:
        path = tmp_path / name
        path.write_text(TINY_HEADER + body, encoding="utf-8")
        return path

    plan.dir = tmp_path
    return plan


TINY_HEADER = """
[run]
name = "tiny"
seed = 7

[model]
use = "scratch"
hidden_size = 32
num_layers = 1
num_heads = 2
intermediate_size = 64
max_position_embeddings = 128
tokenizer_data = ["text", "chat"]
vocab_size = 300

[template]
use = "chatml"

[data.text]
use = "jsonl"
path = "text.jsonl"

[data.chat]
use = "jsonl"
path = "chat.jsonl"

[data.chat_eval]
use = "jsonl"
path = "chat_eval.jsonl"
"""
