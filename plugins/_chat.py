"""Turning rows of the internal schema into token ids and loss labels.

Internal schema (what data sources produce):

* chat rows: ``{"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...]}``
* text rows: ``{"text": str}``

Assistant-only labels come from character spans: the template renders the whole
conversation once, each assistant turn's span is found by rendering the prefix before
it (with the generation prompt) and the conversation up to it, and tokens whose offset
starts inside a span are labelled. This labels every assistant turn, and the end-of-turn
token that closes it, whatever the pad token is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ftcore.errors import FtcoreError

IGNORE = -100


def render_with_spans(template: Any, messages: list[dict], tokenizer: Any) -> tuple[str, list[tuple[int, int]]]:
    text = template.render(messages, tokenizer, add_generation_prompt=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = template.render(messages[:i], tokenizer, add_generation_prompt=True)
        upto = template.render(messages[: i + 1], tokenizer, add_generation_prompt=False)
        if not (text.startswith(upto) and upto.startswith(prefix)):
            raise FtcoreError(f"template '{template.name}' does not render conversations prefix by prefix, "
                              "so assistant turns cannot be located for the loss mask")
        end = len(upto.rstrip("\n ")) if upto.rstrip("\n ") else len(upto)
        spans.append((len(prefix), end))
    return text, spans


@dataclass
class EncodeStats:
    rows: int = 0
    kept: int = 0
    truncated: int = 0
    dropped_no_labels: int = 0
    tokens: int = 0
    label_tokens: int = 0
    extra: dict = field(default_factory=dict)


def encode(rows: Any, tokenizer: Any, template: Any, *, max_length: int | None, train_on_inputs: bool = False,
           add_eos_to_text: bool = True, reporter: Any = None, description: str = "tokenize",
           batch: int = 512) -> tuple[dict[str, list], EncodeStats]:
    """Tokenize rows into ``input_ids`` and ``labels`` lists. Chat rows are labelled on
    assistant turns only (unless ``train_on_inputs``); text rows on every token."""
    stats = EncodeStats()
    out: dict[str, list] = {"input_ids": [], "labels": []}
    n = len(rows)
    with (reporter.progress(description, n) if reporter else _null()) as bar:
        for start in range(0, n, batch):
            chunk = rows[start:start + batch]
            chunk = [dict(zip(chunk, values)) for values in zip(*chunk.values())] if isinstance(chunk, dict) \
                else list(chunk)
            texts, spans = [], []
            for row in chunk:
                if row.get("messages"):
                    text, sp = render_with_spans(template, row["messages"], tokenizer)
                    texts.append(text)
                    spans.append(None if train_on_inputs else sp)
                elif row.get("text") is not None:
                    eos = tokenizer.eos_token if add_eos_to_text and tokenizer.eos_token else ""
                    texts.append(row["text"] + eos)
                    spans.append(None)
                else:
                    raise FtcoreError(f"row {start + len(texts)} has neither 'messages' nor 'text'")
            enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
            for ids, offsets, sp in zip(enc["input_ids"], enc["offset_mapping"], spans):
                stats.rows += 1
                if sp is None:
                    labels = list(ids)
                else:
                    labels = [t if any(a <= s < b for a, b in sp) else IGNORE for t, (s, _) in zip(ids, offsets)]
                if max_length is not None and len(ids) > max_length:
                    ids, labels = ids[:max_length], labels[:max_length]
                    stats.truncated += 1
                n_labels = sum(1 for x in labels if x != IGNORE)
                if n_labels == 0:
                    stats.dropped_no_labels += 1
                    continue
                out["input_ids"].append(list(ids))
                out["labels"].append(labels)
                stats.kept += 1
                stats.tokens += len(ids)
                stats.label_tokens += n_labels
            if reporter:
                bar.advance(len(chunk))
    return out, stats


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def advance(self, n=1):
        pass


def stop_token_ids(tokenizer: Any, template: Any) -> list[int]:
    """EOS plus the template's end-of-turn tokens: generation stops at any of them."""
    ids = []
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    for tok in getattr(template, "stop_tokens", ()):
        tid = tokenizer.convert_tokens_to_ids(tok)
        if tid is not None and tid != tokenizer.unk_token_id and tid not in ids:
            ids.append(tid)
    return ids
