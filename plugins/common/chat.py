"""Turning rows of the internal schema (docs/data.md) into token ids and loss labels.

* chat rows (``messages``) are rendered by the chat template and trained on their
  assistant turns only (unless ``train_on_inputs``);
* completion rows (``prompt`` + ``completion``) are used as plain text, trained on the
  completion and the EOS token after it;
* text rows (``text``) are trained on every token, with EOS appended.

Assistant turns are located in characters of the one rendering of the whole conversation
(:mod:`ftcore_plugins.common.spans`, which works for templates that rewrite history), and
tokens whose first character lies inside a turn are labelled: every assistant turn and the
end-of-turn token that closes it, whatever the pad token is. With ``[template] samples =
"per_turn"`` a conversation becomes one sample per assistant turn, ending with that turn.
"""

from __future__ import annotations

import concurrent.futures
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from ftcore.errors import FtcoreError

from ftcore_plugins.common.spans import SpanError, SpanLocator, template_title

IGNORE = -100
Truncation = Literal["truncate_response", "truncate_prompt", "drop"]


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates expect them: keys Arrow filled with None removed, ``tool_calls``
    (stored as JSON text) parsed back into a list, and ``weight`` (whether a turn is trained) left out."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None and k != "weight"}
        if isinstance(m.get("tool_calls"), str):
            m["tool_calls"] = json.loads(m["tool_calls"])
        out.append(m)
    return out


def prompt_rows(data: Any, stage: str, trainer: str, label: str = "") -> Any:
    """The rows of ``data`` for a trainer that generates answers: it needs chat rows or prompt rows
    (prompt/completion, preference pairs), else one line says what the data has."""
    columns = set(data.column_names)
    if "messages" not in columns and "prompt" not in columns:
        raise FtcoreError(f"stage {stage}: trainer '{trainer}' needs prompts: chat rows (messages) or prompt rows "
                          f"(prompt/completion, preference pairs); this {label + ' ' if label else ''}data has "
                          f"{', '.join(sorted(columns))}"
                          + ("; plain text rows have no prompt to answer" if "text" in columns else ""))
    return data


def chosen_as_chat(data: Any, side: str = "chosen") -> Any:
    """Preference pairs as chat rows: prompt + chosen (or ``side``) as one conversation. SFT trains
    on the chosen answers this way (the usual first stage of SFT -> reward model -> PPO)."""
    if data is None or not {"prompt", side} <= set(data.column_names) or \
            not isinstance(next(iter(data))["prompt"], list):
        return data
    images = "images" in data.column_names  # a pair's images (its prompt's) stay with the conversation
    return data.map(lambda row: {"messages": row["prompt"] + row[side], **({"images": row["images"]} if images else {})},
                    remove_columns=data.column_names)


def prompt_text(row: dict, tokenizer: Any, template: Any) -> str:
    """A row's prompt as text: its conversation without the last assistant turn (the reference
    answer), rendered with the template's generation prompt; a string prompt as it is; "" if none."""
    prompt = row["messages"] if row.get("messages") is not None else row.get("prompt")
    if not isinstance(prompt, list):
        return prompt or ""
    messages = template_messages(prompt)
    if messages and messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    return template.render(messages, tokenizer, add_generation_prompt=True) if messages else ""


def row_tools(row: dict) -> list | None:
    """A chat row's tool schemas (stored as JSON text) as templates expect them, OpenAI style
    (``{"type": "function", "function": schema}``; glaive and others store the bare schema), or None."""
    tools = row.get("tools")
    if isinstance(tools, str):
        tools = json.loads(tools) if tools.strip() else None
    if isinstance(tools, dict):
        tools = [tools]
    return [{"type": "function", "function": t} if isinstance(t, dict) and "function" not in t and "name" in t
            else t for t in tools] if tools else None


def render_with_spans(template: Any, messages: list[dict], tokenizer: Any, tools: list | None = None,
                      locator: SpanLocator | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The conversation as the template renders it and each assistant turn's characters."""
    locator = locator or SpanLocator(template, tokenizer)
    return locator.locate(template_messages(messages), tools)


@dataclass
class EncodeStats:
    rows: int = 0
    samples: int = 0  # one per row, or one per assistant turn with [template] samples = "per_turn"
    kept: int = 0
    truncated: int = 0
    dropped_too_long: int = 0
    dropped_no_labels: int = 0
    skipped_unrenderable: int = 0  # rows the template cannot render or locate turns in (on_error = "skip")
    end_token_added: int = 0  # last turns the template leaves unclosed, closed with its end-of-turn token
    reasoning_dropped: int = 0  # turns trained without reasoning the template does not render (warn mode)
    tokens: int = 0
    label_tokens: int = 0
    lengths: list[int] = field(default_factory=list)  # kept samples' token counts


def row_samples(row: dict, tokenizer: Any, template: Any, *, train_on_inputs: bool = False,
                add_eos_to_text: bool = True, locator: SpanLocator | None = None,
                eos: str | None = None) -> list[tuple[str, list[tuple[int, int]] | None]]:
    """The samples one row becomes: ``(text, spans to train on)`` pairs (spans None: all of it).
    ``eos``: what ends a text row, when the caller has it at hand (a batch's rows share it).
    Raises :class:`FtcoreError` (one line) when the row cannot be rendered or its turns located."""
    if row.get("messages"):
        messages, tools = template_messages(row["messages"]), row_tools(row)
        locator = locator or SpanLocator(template, tokenizer)
        if train_on_inputs:
            return [(locator.render(messages, tools), None)]
        # Assistant turns with weight 0 (loss_weight 0) are context, not trained.
        trained = [i for i, m in enumerate(row["messages"]) if m.get("role") == "assistant" and m.get("weight") != 0]
        if samples_mode(template) == "per_turn":
            # One sample per assistant turn, ending with it: the template renders that turn as the
            # model generates it (a thinking model's reasoning kept), and only it is trained.
            return [locator.locate(messages[:i + 1], tools, turns={i}) for i in trained]
        untrained = len(trained) < sum(m.get("role") == "assistant" for m in messages)
        return [locator.locate(messages, tools, turns=set(trained) if untrained else None)]
    if eos is None:
        eos = tokenizer.eos_token if add_eos_to_text and tokenizer.eos_token else ""
    if row.get("completion") is not None and isinstance(row.get("prompt"), str):
        text = row["prompt"] + row["completion"] + eos
        return [(text, None if train_on_inputs else [(len(row["prompt"]), len(text))])]
    if row.get("text") is not None:
        return [(row["text"] + eos, None)]
    raise FtcoreError(f"a row has none of 'messages', 'prompt'+'completion' or 'text' (it has: {', '.join(row)})")


def samples_mode(template: Any) -> str:
    """``conversation`` (one sample per row) or ``per_turn``, from the template's options."""
    return getattr(getattr(template, "options", None), "samples", "conversation")


def label_spans(ids: list[int], spans: list[tuple[int, int]] | None, token_at: Any) -> list[int]:
    """Labels for ``ids``: the token ids inside ``spans``, IGNORE elsewhere.

    ``token_at(char)`` gives the index of the token covering a character. A token is
    inside a span when its first character is: a token merged across the span's start
    belongs to the prompt.
    """
    if spans is None:
        return list(ids)
    labels = [IGNORE] * len(ids)
    for a, b in spans:
        if a >= b:
            continue
        first = token_at(a)
        if first is not None and token_at.start(first) < a:
            first += 1
        last = token_at(b - 1)
        if first is None or last is None or first > last:
            continue
        labels[first:last + 1] = ids[first:last + 1]
    return labels


class _Offsets:
    """char -> token lookups for one sequence, from a fast tokenizer's Encoding or an offset list."""

    def __init__(self, encoding: Any = None, offsets: list[tuple[int, int]] | None = None):
        self.encoding, self.offsets = encoding, offsets
        if offsets is not None:
            import bisect

            self._starts = [s for s, _ in offsets]
            self._bisect = bisect.bisect_right

    def __call__(self, char: int) -> int | None:
        if self.encoding is not None:
            token = self.encoding.char_to_token(char)
            if token is None:  # a character no token covers (e.g. stripped whitespace): the next token
                token = next((self.encoding.char_to_token(c) for c in range(char + 1, char + 8)
                              if self.encoding.char_to_token(c) is not None), None)
            return token
        i = self._bisect(self._starts, char) - 1
        return i if i >= 0 else None

    def start(self, token: int) -> int:
        return (self.encoding.token_to_chars(token) if self.encoding is not None else self.offsets[token])[0]


def encode(rows: Any, tokenizer: Any, template: Any, *, max_length: int | None, train_on_inputs: bool = False,
           truncation: Truncation = "truncate_response", add_eos_to_text: bool = True, progress: Any = None,
           batch: int = 1000, on_error: str = "error", where: str = "data", first_row: int = 0,
           sink: Any = None, seq2seq: bool = False) -> tuple[dict[str, list], EncodeStats]:
    """Tokenize rows into ``input_ids`` and ``labels`` lists, applying ``max_length`` by
    ``truncation``: cut the end of the response, cut the oldest prompt tokens from the
    left, or drop the sample. Samples left with nothing to learn are dropped and counted.

    With ``sink``, each batch's columns go to ``sink(columns)`` as they are made (returned empty):
    memory holds one batch, whatever the number of rows. ``progress.advance(n)`` follows the rows;
    ``first_row`` is the index of ``rows[0]`` in the whole data, for the messages. Where every token
    of a sample is trained, its ``labels`` is its ``input_ids`` list itself: copy it to change one.

    A row the template cannot render, or whose turns cannot be located, is an error naming
    ``where``, the row and the template, or with ``on_error = "skip"`` a counted skip.

    ``seq2seq``: for an encoder-decoder model, ``input_ids`` the prompt and ``labels`` the answer
    (:func:`ftcore_plugins.common.seq2seq.encode`)."""
    if seq2seq:
        from ftcore_plugins.common import seq2seq as _seq2seq

        return _seq2seq.encode(rows, tokenizer, template, max_length=max_length, truncation=truncation,
                               progress=progress, batch=batch, on_error=on_error, where=where, first_row=first_row,
                               sink=sink)
    stats = EncodeStats()
    locator = SpanLocator(template, tokenizer)
    named = template_title(template)
    eos = tokenizer.eos_token if add_eos_to_text and tokenizer.eos_token else ""

    def samples(index: int, row: dict) -> list:
        try:
            return row_samples(row, tokenizer, template, train_on_inputs=train_on_inputs,
                               add_eos_to_text=add_eos_to_text, locator=locator, eos=eos)
        except FtcoreError as exc:
            if on_error == "skip":
                stats.skipped_unrenderable += 1
                return []
            fix = ('; set [template] use = "chatml" (or another named template), train_on_inputs = true, or '
                   'on_error = "skip" in the data source' if isinstance(exc, SpanError) else
                   '; fix the row, or set on_error = "skip" in the data source to skip such rows')
            message = str(exc)
            message = message if message.startswith(named) else f"{named}: {message}"
            raise FtcoreError(f"{where}, row {first_row + index + 1}: {message}{fix} "
                              "(`ftcore validate --data PLAN` lists every such row with its file and line)") from None
    out: dict[str, list] = {"input_ids": [], "labels": []}
    backend = getattr(tokenizer, "backend_tokenizer", None)  # the Rust tokenizer, when there is one

    def render(start: int) -> tuple[list[str], list, int]:
        chunk = rows[start:start + batch]
        chunk = [dict(zip(chunk, values)) for values in zip(*chunk.values())] if isinstance(chunk, dict) \
            else list(chunk)
        stats.rows += len(chunk)
        pairs = [pair for k, r in enumerate(chunk) for pair in samples(start + k, r)]
        return [t for t, _ in pairs], [sp for _, sp in pairs], len(chunk)

    if backend is not None:
        # transformers leaves padding/truncation switched on in the Rust tokenizer after a
        # padded call (an evaluator's batch generation, say); it resets them per call, and
        # so must we, or every sample would be padded to its batch's longest.
        backend.no_padding()
        backend.no_truncation()

    def tokenize(texts: list[str], spans: list) -> list[tuple[list[int], _Offsets | None]]:
        if backend is not None:  # an Encoding is kept only to locate spans: freed here, off the main thread
            return [(e.ids, None if sp is None else _Offsets(encoding=e))
                    for e, sp in zip(backend.encode_batch(texts, add_special_tokens=False), spans)]
        enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        return [(ids, _Offsets(offsets=off)) for ids, off in zip(enc["input_ids"], enc["offset_mapping"])]

    def label(encoded: list[tuple[list[int], _Offsets | None]], spans: list) -> None:
        for (ids, lookup), sp in zip(encoded, spans):
            stats.samples += 1
            # Every token trained (text rows, train_on_inputs): the labels are the ids' own list, which
            # the Arrow writer then converts once (see arrow_columns).
            labels = ids if sp is None else label_spans(ids, sp, lookup)
            if max_length is not None and len(ids) > max_length:
                if truncation == "drop":
                    stats.dropped_too_long += 1
                    continue
                keep = slice(None, max_length) if truncation == "truncate_response" else slice(-max_length, None)
                ids, labels = (ids[keep], labels[keep]) if sp is not None else (ids[keep],) * 2
                stats.truncated += 1
            n_labels = len(ids) if labels is ids else len(labels) - labels.count(IGNORE)
            if n_labels == 0:
                stats.dropped_no_labels += 1
                continue
            out["input_ids"].append(ids)
            out["labels"].append(labels)
            stats.kept += 1
            stats.tokens += len(ids)
            stats.label_tokens += n_labels
            stats.lengths.append(len(ids))

    # The Rust tokenizer releases the GIL: batch k+1 is rendered and encoded while batch k
    # is labelled, so the Python work overlaps the tokenizer's.
    bar = progress or _NoProgress()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        queued = None
        for start in [*range(0, len(rows), batch), None]:
            following = None
            if start is not None:
                texts, spans, n_rows = render(start)
                following = (pool.submit(tokenize, texts, spans), spans, n_rows)
            if queued is not None:
                label(queued[0].result(), queued[1])
                if sink is not None and out["input_ids"]:
                    sink(out)
                    out = {"input_ids": [], "labels": []}
                bar.advance(queued[2])
            queued = following
    stats.end_token_added, stats.reasoning_dropped = locator.closed_by_us, locator.dropped_reasoning
    return out, stats


class _NoProgress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def advance(self, n=1):
        pass


def stop_token_ids(tokenizer: Any, template: Any) -> list[int]:
    """EOS plus the template's end-of-turn tokens: generation stops at any of them. A template that
    declares none (``native``, a ``jinja`` file) stops where its rendering closes an assistant turn, the
    token its labels train (Gemma's ``<end_of_turn>``, a Llama 3 base tokenizer's ``<|eot_id|>``). Public: where
    every built-in and a plugin's evaluator stop generating (docs/writing-plugins.md, "Chat template")."""
    ids = []
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    tokens = getattr(template, "stop_tokens", ()) or ()
    if not tokens and template is not None and getattr(tokenizer, "get_vocab", None) is not None:
        try:
            tokens = SpanLocator(template, tokenizer).end_tokens()
        except Exception:  # a template that cannot render the probe: EOS alone, as before
            tokens = ()
    for tok in tokens:
        tid = tokenizer.convert_tokens_to_ids(tok)
        if tid is not None and tid != tokenizer.unk_token_id and tid not in ids:
            ids.append(tid)
    return ids
