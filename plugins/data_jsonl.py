"""Data source ``jsonl``: one JSON object per line, as chat ``messages``, Alpaca rows or plain ``text``."""

from __future__ import annotations

import json
from typing import Any, Literal

import ftcore
from ftcore.component import Component, Options
from ftcore.errors import FtcoreError
from ftcore.types import InputPath

ROLES = ("system", "user", "assistant", "tool")
FORMATS = ("auto", "messages", "alpaca", "text")


def to_internal(row: Any, fmt: str) -> tuple[str, dict]:
    """Convert one row to the internal schema; returns (format, row). Raises ValueError."""
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    if fmt == "auto":
        if "messages" in row:
            fmt = "messages"
        elif "instruction" in row and "output" in row:
            fmt = "alpaca"
        elif "text" in row:
            fmt = "text"
        else:
            raise ValueError(f"cannot tell the format: no 'messages', 'instruction'+'output' or 'text' field "
                             f"(fields: {', '.join(row) or 'none'}); set format = \"...\" ({', '.join(FORMATS[1:])})")
    if fmt == "messages":
        messages = row.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' must be a non-empty list")
        out = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}] must be {{\"role\": one of {'/'.join(ROLES)}, \"content\": string}}")
            out.append({"role": m["role"], "content": m["content"]})
        return fmt, {"messages": out}
    if fmt == "alpaca":
        for key in ("instruction", "output"):
            if not isinstance(row.get(key), str):
                raise ValueError(f"missing or non-string field {key!r} (fields: {', '.join(row)})")
        context = row.get("input") or ""
        # `input` is context for the instruction, appended after it.
        prompt = f"{row['instruction']}\n\n{context}" if context else row["instruction"]
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": row["output"]}]
        if row.get("system"):
            messages.insert(0, {"role": "system", "content": row["system"]})
        return fmt, {"messages": messages}
    if not isinstance(row.get("text"), str):
        raise ValueError(f"missing or non-string field 'text' (fields: {', '.join(row)})")
    return "text", {"text": row["text"]}


class JsonlSource(Component):
    """JSON Lines: chat `messages`, Alpaca (`instruction`/`input`/`output`) or `text` rows."""

    name = "jsonl"

    class Options(Options):
        path: InputPath
        format: Literal[FORMATS] = "auto"  # type: ignore[valid-type]
        limit: int | None = None  # read at most this many rows

    def inputs(self):
        return [self.options.path]

    def load(self, ctx):
        import datasets

        path, rows, kinds = self.options.path, [], set()
        with path.open("rb") as fh:
            for lineno, raw in enumerate(fh, 1):
                if self.options.limit is not None and len(rows) >= self.options.limit:
                    break
                try:
                    line = raw.decode("utf-8").strip()
                except UnicodeDecodeError as exc:
                    raise FtcoreError(f"data.{ctx.name}: {path}:{lineno}: not UTF-8 ({exc.reason})") from None
                if not line:
                    continue
                try:
                    kind, row = to_internal(json.loads(line), self.options.format)
                except json.JSONDecodeError as exc:
                    raise FtcoreError(f"data.{ctx.name}: {path}:{lineno}: invalid JSON: {exc.msg} "
                                      f"(column {exc.colno})") from None
                except ValueError as exc:
                    raise FtcoreError(f"data.{ctx.name}: {path}:{lineno}: {exc}") from None
                kinds.add("text" if kind == "text" else "chat")
                rows.append(row)
        if not rows:
            raise FtcoreError(f"data.{ctx.name}: {path}: no rows")
        if len(kinds) > 1:
            raise FtcoreError(f"data.{ctx.name}: {path}: mixes chat and plain-text rows; split them into two files")
        ctx.reporter.info(f"data [bold]{ctx.name}[/]: {len(rows):,} {kinds.pop()} rows from {path.name}")
        return datasets.Dataset.from_list(rows)


@ftcore.hookimpl
def register_data_sources(register):
    register(JsonlSource)
