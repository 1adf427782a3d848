"""Row formats: one raw row (a dict) -> one row of the internal schema (see docs/data.md).

Pure Python, no heavy imports at module level. :func:`convert` handles one row and raises
:class:`RowError` (a ``ValueError``) with a one-line message naming the field;
:func:`convert_batch` is the batched form for ``datasets.Dataset.map(batched=True)``: it
never raises for a bad row, it records the problem in an ``__error`` column so the
caller can report the first one (deterministically, whatever ``num_proc`` is) or skip
them all.

Formats (``format = "..."``) and what they produce:

=====================  ==============================================  ======================
format                 fields                                          kind
=====================  ==============================================  ======================
``alpaca``             instruction, input?, output, system?, history?  chat
``sharegpt``           conversations (from/value), system?, tools?     chat
``messages``           messages (role/content), tools?                 chat
``prompt_completion``  prompt, completion                              completion or chat
``preference``         prompt, chosen, rejected                        preference
``sharegpt_preference``  conversations, chosen, rejected               preference
``implicit_preference``  chosen, rejected (whole conversations)        preference
``kto``                label + messages / conversations / prompt+completion   unpaired_preference
``text``               text                                            text
=====================  ==============================================  ======================
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from ftcore_plugins.common import images as _images

ROLES = ("system", "user", "assistant", "tool")
# ShareGPT "from" values and the role each becomes.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "function_call": "assistant", "observation": "tool", "tool": "tool"}

FORMATS = ("alpaca", "sharegpt", "messages", "prompt_completion", "preference", "sharegpt_preference",
           "implicit_preference", "kto", "text")
ALIASES = {"openai": "messages"}  # other names accepted for a format
FORMAT_NAMES = ("auto", *FORMATS, *ALIASES)

KINDS = ("chat", "completion", "preference", "unpaired_preference", "text")
# The columns of each kind, in order (chat's `tools` and `images` are dropped again when no row has them).
KIND_COLUMNS = {
    "chat": ("messages", "tools", "images"),
    "completion": ("prompt", "completion"),
    "preference": ("prompt", "chosen", "rejected", "images"),
    "unpaired_preference": ("prompt", "completion", "label"),
    "text": ("text",),
}
INTERNAL_COLUMNS = ("messages", "tools", "images", "prompt", "completion", "chosen", "rejected", "label", "text")
MESSAGE_COLUMNS = ("messages", "prompt", "chosen", "rejected", "completion")  # when they hold message lists
# Every message key a chat template reads: Mistral's and Kimi's templates render a tool result's
# `tool_call_id` (and refuse the row without it), so none is dropped when the data is read.
MESSAGE_KEYS = ("role", "content", "tool_calls", "name", "reasoning_content", "tool_call_id", "weight")
# `weight`: 0 on an assistant turn that is not trained (OpenAI's `weight`, LLaMA-Factory's `loss_weight`);
# absent (null) on every other message. Templates never see it (chat.template_messages drops it).
WEIGHT_KEYS = ("weight", "loss_weight")
# Names reasoning arrives under: transformers' templates read `reasoning_content`, gpt-oss's `thinking`.
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")

# Our field names: what `columns = { <ours> = "<theirs>" }` may map.
FIELDS = ("instruction", "input", "output", "system", "history", "conversations", "tools", "messages", "prompt",
          "completion", "chosen", "rejected", "label", "text", "images")

ERROR_COLUMN = "__error"
FORMAT_COLUMN = "__format"
PLACEHOLDER_COLUMN = "__placeholder"  # with placeholders = "warn": the first placeholder a row holds
PLACEHOLDERS = ("warn", "error", "allow")
# An unfilled Jinja/mustache-like slot: "{{name}}", "{{ user.name }}"; not "{{ a + b }}" or "{{}}".
PLACEHOLDER = re.compile(r"\{\{\s*[A-Za-z_][\w.]*\s*\}\}")
# Rows that are skipped and counted even with on_error = "error": they are valid, but teach nothing.
ALWAYS_SKIP = ("identical_chosen_rejected", "empty_text")
_SEP = "\x1f"


class RowError(ValueError):
    """A row that cannot be converted. ``reason`` is a short stable key for statistics
    (``missing_field``, ``wrong_type``, ...); ``field`` is the field at fault, if one is."""

    def __init__(self, message: str, reason: str = "invalid_row", field: str | None = None):
        super().__init__(message)
        self.reason = reason
        self.field = field

    def __reduce__(self):  # picklable across datasets' worker processes
        return (type(self), (str(self), self.reason, self.field))

    def encode(self) -> str:
        return _SEP.join((self.reason, self.field or "", str(self)))

    @classmethod
    def decode(cls, text: str) -> RowError:
        reason, field, message = text.split(_SEP, 2)
        return cls(message, reason, field or None)


# -- helpers ---------------------------------------------------------------------------------------

def _present(row: Mapping, key: str) -> bool:
    return row.get(key) is not None


def _fields(row: Mapping) -> str:
    return ", ".join(k for k, v in row.items() if v is not None and not k.startswith("__")) or "none"


def _kind_of_value(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    return {str: "a string", list: "a list", tuple: "a list", dict: "an object", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


class _Ctx:
    """What the helpers need to write good messages: the row and the column mapping."""

    __slots__ = ("row", "columns", "fmt", "explicit", "placeholders", "placeholder", "part_tools", "images", "base",
                 "images_used")

    def __init__(self, row: Mapping, columns: Mapping[str, str], fmt: str, explicit: bool,
                 placeholders: str = "allow"):
        self.row, self.columns, self.fmt, self.explicit = row, columns, fmt, explicit
        self.placeholders = placeholders
        self.placeholder: tuple[str, str] | None = None  # (field, placeholder): the first one seen
        self.part_tools: str | None = None  # tool schemas given as a message's "tools" part (LLaMA-Factory v1)
        self.images: list[tuple[str, Any]] = []  # image content parts met, in order: (where, value)
        self.base: str | None = None  # the data file's folder: relative image paths are relative to it
        self.images_used = False  # the row's format reads images (else a row that has some is refused)

    def text(self, value: str, field: str) -> str:
        """Message text, looked at for unfilled template placeholders (``placeholders`` option)."""
        if self.placeholders != "allow" and self.placeholder is None and "{{" in value:
            found = PLACEHOLDER.search(value)
            if found is not None:
                if self.placeholders == "error":
                    raise RowError(f"{field!r} holds the template placeholder {found.group()!r}, never filled in "
                                   "(set placeholders = \"allow\" in the source to train it as it is)", "placeholder",
                                   field.split("[", 1)[0].split(".", 1)[0])
                self.placeholder = (field, found.group())
        return value

    def missing(self, field: str) -> RowError:
        if field in self.row and field not in self.columns:
            hint = f"(it is empty or null in this row; fields: {_fields(self.row)})"
            # A file whose rows differ (read as one table, every row has every column, null where absent):
            # this row's own fields may look like a known format.
            suggested = suggest_columns({k: v for k, v in self.row.items() if v is not None})
            if suggested is not None and field in suggested[1]:
                hint += f"; they look like {suggested[0]}: set {columns_toml(suggested[1])} in the source"
        elif field in self.columns:
            hint = f"(mapped from the file's {self.columns[field]!r}, which is empty or absent in this row)"
        else:
            ours = {"instruction": "prompt", "completion": "output"}.get(field, field)
            theirs = _lookalike(self.row, ours, set()) if ours in LOOKALIKES else None
            hint = f"(fields: {_fields(self.row)}); map it with " + (
                columns_toml({field: theirs}) if theirs else f"columns = {{ {field} = \"...\" }}")
        if not self.explicit:
            hint += f" or set format = \"...\" (read as {self.fmt!r} from the fields)"
        return RowError(f"missing field {field!r} {hint}", "missing_field", field)

    def wrong_type(self, field: str, expected: str, value: Any) -> RowError:
        return RowError(f"field {field!r} must be {expected}, got {_kind_of_value(value)}", "wrong_type",
                        field.split("[", 1)[0].split(".", 1)[0])

    def string(self, field: str, required: bool = True) -> str | None:
        value = self.row.get(field)
        if value is None:
            if required:
                raise self.missing(field)
            return None
        if not isinstance(value, str):
            raise self.wrong_type(field, "a string", value)
        return value

    def message_text(self, field: str, required: bool = True) -> str | None:
        """A string field that becomes a message's content (alpaca's, ``system``)."""
        value = self.string(field, required)
        return value if value is None else self.text(value, field)


def _json_text(value: Any, field: str, ctx: _Ctx) -> str | None:
    """Tool definitions and tool calls are stored as JSON strings; empty ones as None."""
    if value is None:
        return None
    if isinstance(value, str):
        if value.strip() in ("", "[]", "{}", "null"):
            return None
        try:
            json.loads(value)
        except json.JSONDecodeError as exc:
            raise RowError(f"field {field!r} is not valid JSON: {exc.msg} (column {exc.colno})", "wrong_type",
                           field.split("[", 1)[0]) from None
        return value
    if isinstance(value, (list, dict)):
        return json.dumps(value, ensure_ascii=False) if value else None
    raise ctx.wrong_type(field, "a JSON string, a list or an object", value)


def _content(value: Any, where: str, ctx: _Ctx, allow_empty: bool) -> str:
    if isinstance(value, str):
        return ctx.text(value, f"{where}.content")
    if value is None:
        if allow_empty:
            return ""
        raise RowError(f"missing field '{where}.content' (message fields: "
                       f"{_fields(_get_message(ctx, where))})", "missing_field", where.split("[", 1)[0])
    if isinstance(value, list):  # OpenAI content parts: text, and images (each becomes a placeholder)
        return ctx.text("".join(_image_part(p, f"{where}.content[{j}]", ctx) or _text_part(p, f"{where}.content[{j}]", ctx)
                                for j, p in enumerate(value)), f"{where}.content")
    raise ctx.wrong_type(f"{where}.content", "a string (or a list of text and image parts)", value)


def _image_part(part: Any, where: str, ctx: _Ctx) -> str | None:
    """An image content part -> the image placeholder (its image recorded in ``ctx.images``); None for
    any other part. OpenAI/TRL's ``{"type": "image", "image": ...}`` (or ``url``/``path``) and
    ``{"type": "image_url", "image_url": {"url": ...}}``."""
    if not isinstance(part, Mapping) or part.get("type") not in ("image", "image_url"):
        return None
    value = next((part[k] for k in ("image", "image_url", "url", "path") if part.get(k) is not None), None)
    if value is None:
        raise RowError(f"{where!r} is an image part with no image (give 'image' or 'image_url'; part fields: "
                       f"{_fields(part)})", "missing_field", where.split("[", 1)[0])
    ctx.images.append((where, value))
    return _images.IMAGE


def _valued(parts: Any) -> bool:
    """Content given as LLaMA-Factory v1's typed parts, ``[{"type": "text", "value": ...}, ...]``:
    every part an object with ``value`` and none with OpenAI's ``text``."""
    return isinstance(parts, (list, tuple)) and bool(parts) and all(
        isinstance(p, Mapping) and "value" in p and "text" not in p for p in parts)


def _valued_parts(parts: list, where: str, ctx: _Ctx) -> tuple[str, str | None, str | None]:
    """LLaMA-Factory v1's content parts -> (text, reasoning, tool calls as JSON text): ``text`` parts
    are joined, ``reasoning`` parts are the reasoning, ``tool_call``/``tool_calls`` parts (JSON of
    ``{"name", "arguments"}``, or a list of them) the calls, a ``tools`` part the row's tool schemas."""
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict] = []
    field = where.split("[", 1)[0]
    for j, part in enumerate(parts):
        at = f"{where}.content[{j}]"
        kind, value = part.get("type"), part.get("value")
        if kind in ("tool_call", "tool_calls", "tools") and isinstance(value, (list, dict)):
            value = json.dumps(value, ensure_ascii=False)
        if not isinstance(value, str):
            raise ctx.wrong_type(f"{at}.value", "a string", value)
        if kind == "text":
            texts.append(value)
        elif kind == "reasoning":
            reasoning.append(value)
        elif kind in ("tool_call", "tool_calls"):
            calls += _tool_calls(value, at, f"a {kind} part")
        elif kind == "tools":
            ctx.part_tools = _json_text(value, f"{at}.value", ctx)
        else:
            raise RowError(f"{at!r} is {'an untyped' if kind is None else f'a {kind!r}'} part; ftcore reads text, "
                           "reasoning, tool_call and tools parts", "wrong_type", field)
    text = ctx.text("".join(texts), f"{where}.content")
    thought = "\n".join(r for r in reasoning if r.strip()) or None
    return text, thought, json.dumps(calls, ensure_ascii=False) if calls else None


def _weight(m: Mapping, where: str, role: str) -> int | None:
    """0 for an assistant turn that is not trained (``weight`` or ``loss_weight`` 0), else None.
    Only 0 and 1 are read: ftcore trains a turn or not."""
    field = where.split("[", 1)[0]
    for key in WEIGHT_KEYS:
        value = m.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value not in (0, 1):
            raise RowError(f"'{where}.{key}' must be 0 (not trained) or 1 (trained), got {value!r}: ftcore trains "
                           "a turn or not", "wrong_type", field)
        if value == 1 and role != "assistant":
            raise RowError(f"'{where}' is a {role} turn with {key} = 1, but only assistant turns are trained (set "
                           "train_on_inputs = true in the stage to train the whole conversation)", "wrong_type", field)
        return 0 if value == 0 and role == "assistant" else None
    return None


def _text_part(part: Any, where: str, ctx: _Ctx) -> str:
    """One OpenAI content part, ``{"type": "text", "text": ...}``; the message says what is off."""
    field = where.split("[", 1)[0]
    if not isinstance(part, Mapping):
        raise ctx.wrong_type(where, 'a text part {"type": "text", "text": ...}', part)
    if part.get("type") != "text":
        kind = part.get("type")
        raise RowError(f"{where!r} is {'an untyped' if kind is None else f'a {kind!r}'} part; only text parts "
                       "{\"type\": \"text\", \"text\": ...} and image parts are supported", "wrong_type", field)
    text = part.get("text")
    if isinstance(text, str):
        return text
    if text is None:
        # Not an alias: `value` belongs to ShareGPT turns, and guessing here would hide a mixed-up file.
        other = next((k for k in ("value", "content") if isinstance(part.get(k), str)), None)
        if other is not None:
            raise RowError(f"{where!r} has {other!r}; text parts need 'text'", "missing_field", field)
        raise RowError(f"missing field '{where}.text' (part fields: {_fields(part)})", "missing_field", field)
    raise ctx.wrong_type(f"{where}.text", "a string", text)


def _reasoning(m: Mapping, where: str, role: str, ctx: _Ctx) -> str | None:
    """The reasoning of a message, under any of :data:`REASONING_KEYS`; empty counts as none."""
    given = {}
    for key in REASONING_KEYS:
        value = m.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise ctx.wrong_type(f"{where}.{key}", "a string", value)
        if value.strip():
            given[key] = value
    if not given:
        return None
    (first, text), *rest = given.items()
    for key, other in rest:
        if other != text:
            raise RowError(f"'{where}' has both {first!r} and {key!r}, and they differ; give the reasoning once",
                           "conflicting_fields", where.split("[", 1)[0])
    if role != "assistant":
        raise RowError(f"'{where}' is a {role} turn with {first!r}; only assistant turns carry reasoning",
                       "wrong_type", where.split("[", 1)[0])
    return text


def _get_message(ctx: _Ctx, where: str) -> Mapping:
    try:
        field, rest = where.split("[", 1)
        return ctx.row[field][int(rest.split("]", 1)[0])]
    except Exception:
        return {}


def _tool_calls(value: str, where: str, what: str = "a function_call turn") -> list[dict]:
    """A ShareGPT function_call value (or LLaMA-Factory v1's tool_call part) -> OpenAI-style tool calls."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise RowError(f"'{where}.value' of {what} must be JSON like "
                       f"{{\"name\": ..., \"arguments\": ...}}: {exc.msg} (column {exc.colno})",
                       "wrong_type", where.split("[", 1)[0]) from None
    calls = parsed if isinstance(parsed, list) else [parsed]
    out = []
    for call in calls:
        if isinstance(call, dict) and isinstance(call.get("function"), dict):
            call = call["function"]  # already OpenAI-style
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise RowError(f"'{where}.value' of {what} must hold {{\"name\": string, "
                           f"\"arguments\": ...}} (or a list of them)", "wrong_type", where.split("[", 1)[0])
        out.append({"type": "function", "function": {"name": call["name"], "arguments": call.get("arguments", {})}})
    return out


def _messages(value: Any, field: str, ctx: _Ctx, *, nonempty: bool = True,
              wheres: list[str] | None = None) -> list[dict]:
    """A list of messages, each ``{role, content}`` (OpenAI) or ``{from, value}`` (ShareGPT).
    ``wheres`` receives each result's place in the row (``messages[2]``), for :func:`_check_turns`."""
    wheres = [] if wheres is None else wheres
    if value is None:
        raise ctx.missing(field)
    if not isinstance(value, (list, tuple)):
        raise ctx.wrong_type(field, "a list of messages", value)
    if not value and nonempty:
        raise RowError(f"empty conversation: {field!r} has no messages", "empty_conversation", field)
    out: list[dict] = []
    pending_names: list[str] = []  # tool names of the last function_call, for the observations after it
    for i, m in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(m, Mapping):
            raise ctx.wrong_type(where, "a message object", m)
        if m.get("from") is not None or (m.get("role") is None and "value" in m):
            tag = m.get("from")
            if tag is None:
                raise RowError(f"missing field '{where}.from' (message fields: {_fields(m)})", "missing_field", field)
            if tag not in SHAREGPT_ROLES:
                raise RowError(f"unknown role {tag!r} in '{where}.from' (expected one of: "
                               f"{', '.join(SHAREGPT_ROLES)})", "unknown_role", field)
            text = m.get("value")
            if not isinstance(text, str):
                if text is None:
                    raise RowError(f"missing field '{where}.value' (message fields: {_fields(m)})",
                                   "missing_field", field)
                raise ctx.wrong_type(f"{where}.value", "a string", text)
            role = SHAREGPT_ROLES[tag]
            reasoning = _reasoning(m, where, role, ctx)  # not ShareGPT's own, but distilled sets add it
            if tag == "function_call":
                calls = _tool_calls(text, where)
                pending_names = [c["function"]["name"] for c in calls]
                encoded = json.dumps(calls, ensure_ascii=False)
                if out and out[-1]["role"] == "assistant" and "tool_calls" not in out[-1] and reasoning is None:
                    out[-1]["tool_calls"] = encoded  # "I'll look that up" + the call: one turn
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": encoded})
                    if reasoning is not None:
                        out[-1]["reasoning_content"] = reasoning
                    wheres.append(where)
                continue
            message = {"role": role, "content": ctx.text(text, f"{where}.value")}
            if reasoning is not None:
                message["reasoning_content"] = reasoning
            if role == "tool" and pending_names:
                message["name"] = pending_names.pop(0)
            out.append(message)
            wheres.append(where)
            continue
        role = m.get("role")
        if role is None:
            raise RowError(f"missing field '{where}.role' (message fields: {_fields(m)}); messages need "
                           "{\"role\", \"content\"} or ShareGPT's {\"from\", \"value\"}", "missing_field", field)
        if role not in ROLES:
            raise RowError(f"unknown role {role!r} in '{where}.role' (expected one of: {', '.join(ROLES)})",
                           "unknown_role", field)
        calls = _json_text(m.get("tool_calls"), f"{where}.tool_calls", ctx)
        content, part_reasoning = m.get("content"), None
        if _valued(content):  # LLaMA-Factory v1: typed parts holding the text, reasoning and calls
            content, part_reasoning, part_calls = _valued_parts(content, where, ctx)
            if part_calls is not None:
                if calls is not None:
                    raise RowError(f"'{where}' has tool_calls and tool_call parts; give the calls once",
                                   "conflicting_fields", field)
                calls = part_calls
        if calls is not None and role != "assistant":
            raise RowError(f"'{where}' has tool_calls but is a {role} turn; only assistant turns call tools",
                           "wrong_type", field)
        reasoning = _reasoning({**m, "reasoning_content": m.get("reasoning_content") or part_reasoning}, where,
                               role, ctx)
        message = {"role": role, "content": _content(content, where, ctx,
                                                     allow_empty=calls is not None or reasoning is not None)}
        if calls is not None:
            message["tool_calls"] = calls
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if _weight(m, where, role) == 0:
            message["weight"] = 0
        if role == "tool":
            name = m.get("name")
            if name is not None:
                if not isinstance(name, str):
                    raise ctx.wrong_type(f"{where}.name", "a string", name)
                message["name"] = name
            elif pending_names:
                message["name"] = pending_names.pop(0)
            call_id = m.get("tool_call_id")
            if call_id is not None:
                if not isinstance(call_id, (str, int)) or isinstance(call_id, bool):
                    raise ctx.wrong_type(f"{where}.tool_call_id", "a string", call_id)
                message["tool_call_id"] = str(call_id)
        if calls is not None:
            pending_names = _call_names(calls)
        out.append(message)
        wheres.append(where)
    return out


def _check_turns(messages: list[dict], wheres: list[str], *, answer: str | None = None) -> None:
    """The order rules of a conversation (docs/data.md): system only first; a tool result only
    after an assistant turn that calls tools (or another result); no two user turns, nor two
    assistant turns unless the first calls tools; no empty assistant turn; with ``answer`` (the
    conversation's field), at least one assistant turn. ``wheres`` names each message's place."""
    prev: dict | None = None
    for m, where in zip(messages, wheres):
        role, field = m["role"], where.split("[", 1)[0]
        what = f"{where!r}" if "[" in where else f"the {where!r} field"
        if role == "system" and prev is not None:
            raise RowError(f"{what} is a system turn after a {prev['role']} turn; the system message may only "
                           "come first (once)", "role_order", field)
        if role == "tool" and not (prev is not None and (prev["role"] == "tool" or prev.get("tool_calls"))):
            after = f"a {prev['role']} turn without tool_calls" if prev is not None else "nothing"
            raise RowError(f"{what} is a tool result after {after}; tool results follow the assistant turn that "
                           "calls the tool", "role_order", field)
        if prev is not None and role == prev["role"] and role == "user":
            raise RowError(f"{what} is a second user turn in a row; merge them into one message", "role_order",
                           field)
        if prev is not None and role == prev["role"] == "assistant" and not prev.get("tool_calls"):
            raise RowError(f"{what} is a second assistant turn in a row; merge them into one message",
                           "role_order", field)
        if role == "assistant" and not m["content"].strip() and not m.get("tool_calls") \
                and not m.get("reasoning_content"):
            raise RowError(f"{what} is an assistant turn with empty content (and no tool_calls): it would train "
                           "on the end-of-turn token alone", "empty_answer", field)
        prev = m
    if answer is not None and not any(m["role"] == "assistant" for m in messages):
        raise RowError(f"{answer!r} has no assistant turn, so there is nothing to train on (roles: "
                       f"{', '.join(m['role'] for m in messages)})", "no_answer", answer)


def _call_names(calls: str) -> list[str]:
    try:
        parsed = json.loads(calls)
        parsed = parsed if isinstance(parsed, list) else [parsed]
        names = []
        for c in parsed:
            fn = c.get("function", c) if isinstance(c, dict) else {}
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                names.append(fn["name"])
        return names
    except (ValueError, AttributeError):
        return []


def _system(ctx: _Ctx, wheres: list[str] | None = None) -> list[dict]:
    system = ctx.message_text("system", required=False)
    if not system:
        return []
    if wheres is not None:
        wheres.append("system")
    return [{"role": "system", "content": system}]


def _answer(value: Any, field: str, ctx: _Ctx, wheres: list[str] | None = None) -> list[dict]:
    """A preference answer: a string (one assistant turn), one message, or a list of messages."""
    wheres = [] if wheres is None else wheres
    if value is None:
        raise ctx.missing(field)
    if isinstance(value, str):
        wheres.append(field)
        return [{"role": "assistant", "content": ctx.text(value, field)}]
    if isinstance(value, Mapping):
        return _messages([value], field, ctx, wheres=wheres)
    return _messages(value, field, ctx, wheres=wheres)


def _prompt(value: Any, field: str, ctx: _Ctx, wheres: list[str] | None = None) -> list[dict]:
    """A prompt: a string (one user turn) or a list of messages."""
    wheres = [] if wheres is None else wheres
    if value is None:
        raise ctx.missing(field)
    if isinstance(value, str):
        wheres.append(field)
        return [{"role": "user", "content": ctx.text(value, field)}]
    return _messages(value, field, ctx, wheres=wheres)


def _pair(ctx: _Ctx, prompt: list[dict], where: list[str]) -> tuple[list[dict], list[dict]]:
    """``chosen`` and ``rejected`` after ``prompt``, each checked as the conversation it ends."""
    answers = []
    for field in ("chosen", "rejected"):
        wheres: list[str] = []
        answer = _answer(ctx.row.get(field), field, ctx, wheres)
        _check_turns(prompt + answer, where + wheres)
        answers.append(answer)
    return answers[0], answers[1]


def _label(ctx: _Ctx, strings: bool) -> bool:
    value = ctx.row.get("label")
    if value is None:
        raise ctx.missing("label")
    if isinstance(value, bool):
        return value
    if strings and isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")  # CSV has no booleans
    raise RowError(f"field 'label' must be a boolean (true = desirable, false = undesirable), got "
                   f"{_kind_of_value(value)} {value!r}", "label_not_bool", "label")


def _distinct(chosen: list[dict], rejected: list[dict]) -> None:
    if chosen == rejected:
        raise RowError("'chosen' and 'rejected' are identical, so the pair teaches nothing",
                       "identical_chosen_rejected", "chosen")


# -- detection ---------------------------------------------------------------------------------------

DETECTION = (
    # (format, fields that must all be present, any of these too (or none))
    ("kto", ("label",), ("messages", "conversations", "completion")),
    ("sharegpt_preference", ("conversations", "chosen", "rejected"), ()),
    ("preference", ("prompt", "chosen", "rejected"), ()),
    ("implicit_preference", ("chosen", "rejected"), ()),
    ("sharegpt", ("conversations",), ()),
    ("messages", ("messages",), ()),
    ("alpaca", ("instruction",), ()),
    ("prompt_completion", ("prompt", "completion"), ()),
    ("text", ("text",), ()),
)


def detect(row: Mapping) -> str:
    """The format of a row from its non-null fields; first match in :data:`DETECTION` wins.
    When none matches, the fields it has at all (null or not) decide, so that a row with an
    empty cell is read as its columns say and then reported for the empty cell. A row that
    matches none gets the mapping its fields suggest (:func:`suggest_columns`), if any."""
    for has in (_present, lambda r, f: f in r):
        for fmt, required, any_of in DETECTION:
            if all(has(row, f) for f in required) and (not any_of or any(has(row, f) for f in any_of)):
                return fmt
    suggested = suggest_columns(row)
    if suggested is not None:
        what, columns = suggested
        raise RowError(f"cannot tell the row's format from its fields ({_fields(row)}); they look like {what}: "
                       f"set {columns_toml(columns)} in the source", "unknown_format", None)
    raise RowError(f"cannot tell the row's format from its fields ({_fields(row)}); map them to our field "
                   f"names with columns = {{ <ours> = \"<theirs>\" }} (ours: {', '.join(FIELDS)}) or set "
                   f"format = \"...\" ({', '.join(FORMATS)})", "unknown_format", None)


# Field names other projects give what our fields hold, most telling first (lower case). StackExchange
# paired sets (response_j better than response_k), Anthropic HH, UltraFeedback, SQuAD-like QA, corpora.
LOOKALIKES = {
    "prompt": ("question", "query", "prompt_text", "instruction_text", "problem", "request", "context", "input_text",
               "user", "human", "post", "history_text"),
    "chosen": ("response_j", "chosen_response", "response_chosen", "chosen_answer", "preferred",
               "preferred_response", "better", "better_response", "accepted", "accepted_answer", "winner", "good",
               "positive", "pos"),
    "rejected": ("response_k", "rejected_response", "response_rejected", "rejected_answer", "dispreferred",
                 "dispreferred_response", "worse", "worse_response", "loser", "bad", "negative", "neg"),
    "output": ("response", "answer", "answers", "reply", "solution", "target", "output_text", "completion_text",
               "assistant", "gpt", "bot", "label_text"),
    "text": ("content", "document", "body", "passage", "article", "raw_text", "sentence", "contents"),
}


def _lookalike(row: Mapping, ours: str, taken: set[str]) -> str | None:
    names = {str(k).lower(): k for k in row if not str(k).startswith("__") and k not in taken}
    return next((names[n] for n in LOOKALIKES[ours] if n in names), None)


def suggest_columns(row: Mapping) -> tuple[str, dict[str, str]] | None:
    """``(what the row looks like, columns = {ours: theirs})`` from field names other projects use
    (:data:`LOOKALIKES`), or None: ``question``, ``response_j``, ``response_k`` look like preference
    pairs, ``{prompt = "question", chosen = "response_j", rejected = "response_k"}``."""
    taken: set[str] = set()

    def find(ours: str) -> str | None:
        found = _lookalike(row, ours, taken)
        if found is not None:
            taken.add(found)
        return found

    def pick(*fields: str) -> dict[str, str | None] | None:
        """Each of ``fields`` (ours) found under its own name (None: no mapping needed) or a lookalike."""
        taken.clear()
        out = {ours: None if row.get(ours) is not None else find(ours) for ours in fields}
        return out if all(row.get(k) is not None or v for k, v in out.items()) else None

    for what, fields in (("preference pairs", ("prompt", "chosen", "rejected")),
                         ("whole conversations as preference pairs", ("chosen", "rejected")),
                         ("instructions and answers (Alpaca)", ("prompt", "output")),
                         ("plain text", ("text",))):
        found = pick(*fields)
        if found is not None and any(found.values()):
            renamed = {"prompt": "instruction"} if "output" in fields else {}
            return what, {renamed.get(k, k): v for k, v in found.items() if v}
    return None


def columns_toml(columns: Mapping[str, str]) -> str:
    """``columns = { prompt = "question", ... }``, as a plan writes it."""
    return "columns = { " + ", ".join(f"{ours} = {json.dumps(str(theirs))}" for ours, theirs in columns.items()) + " }"


# -- conversions --------------------------------------------------------------------------------------

def _alpaca(ctx: _Ctx, strings: bool) -> tuple[str, dict]:
    instruction = ctx.message_text("instruction")
    output = ctx.message_text("output")
    context = ctx.message_text("input", required=False)
    wheres: list[str] = []
    messages = _system(ctx, wheres)
    history = ctx.row.get("history")
    if history is not None:
        if not isinstance(history, (list, tuple)):
            raise ctx.wrong_type("history", "a list of [user, assistant] pairs", history)
        for i, pair in enumerate(history):
            if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(p, str) for p in pair)):
                raise ctx.wrong_type(f"history[{i}]", "a [user, assistant] pair of strings", pair)
            messages += [{"role": "user", "content": ctx.text(pair[0], f"history[{i}][0]")},
                         {"role": "assistant", "content": ctx.text(pair[1], f"history[{i}][1]")}]
            wheres += [f"history[{i}][0]", f"history[{i}][1]"]
    # `input` is context for the instruction: after it, separated by a blank line.
    prompt = f"{instruction}\n\n{context}" if context else instruction
    messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}]
    _check_turns(messages, [*wheres, "instruction", "output"])
    return "chat", {"messages": messages, "tools": None}


def _tools(ctx: _Ctx) -> str | None:
    tools = _json_text(ctx.row.get("tools"), "tools", ctx)
    return tools if tools is not None else ctx.part_tools


def _conversation(ctx: _Ctx, field: str, answer: bool) -> tuple[list[dict], list[str]]:
    """The row's ``system`` and the messages of ``field``, checked in order."""
    wheres: list[str] = []
    messages = _system(ctx, wheres)
    messages += _messages(ctx.row.get(field), field, ctx, wheres=wheres)
    _check_turns(messages, wheres, answer=field if answer else None)
    return messages, wheres


# Chat rows need no assistant turn: a prompt-only conversation is what GRPO and the generation
# evaluator take; sft drops it, counted as dropped_no_labels.
def _sharegpt(ctx: _Ctx, strings: bool) -> tuple[str, dict]:
    messages, _ = _conversation(ctx, "conversations", answer=False)
    messages, images = _with_images(ctx, messages)
    return "chat", {"messages": messages, "tools": _tools(ctx), **({"images": images} if images else {})}


def _openai(ctx: _Ctx, strings: bool) -> tuple[str, dict]:
    messages, _ = _conversation(ctx, "messages", answer=False)
    messages, images = _with_images(ctx, messages)
    return "chat", {"messages": messages, "tools": _tools(ctx), **({"images": images} if images else {})}


def _with_images(ctx: _Ctx, messages: list[dict]) -> tuple[list[dict], list[str] | None]:
    """A chat row's images (a top-level ``images`` list, or image content parts) as references, each
    checked (it exists, is not empty, decodes), and the messages with one placeholder per image
    (:func:`ftcore_plugins.common.images.placed`). ``(messages, None)`` for a row without images."""
    ctx.images_used = True
    given = ctx.row.get("images")
    if given is None and not ctx.images:
        if "images" in ctx.row and any(_images.IMAGE in m["content"] for m in messages):
            raise RowError(f"the text holds {_images.IMAGE} but 'images' is empty in this row", "image_count", "images")
        return messages, None
    if given is not None and not isinstance(given, (list, tuple)):
        given = [given]
    if given and ctx.images:
        raise RowError(f"the row has both an 'images' list and image parts ({ctx.images[0][0]!r}); give its images "
                       "one way", "conflicting_fields", "images")
    items = ctx.images or [(f"images[{i}]", v) for i, v in enumerate(given or [])]
    refs = []
    for n, (where, value) in enumerate(items, 1):
        try:
            ref = _images.reference(value, ctx.base)
            _images.check_image(ref)
        except _images.ImageError as exc:
            raise RowError(f"image {n} ({where}): {exc}", exc.reason, where.split("[", 1)[0]) from None
        refs.append(ref)
    try:
        messages = _images.placed(messages, len(refs))
    except _images.ImageError as exc:
        raise RowError(str(exc), exc.reason, "images") from None
    return messages, refs or None


def _prompt_completion(ctx: _Ctx, strings: bool) -> tuple[str, dict]:
    prompt, completion = ctx.row.get("prompt"), ctx.row.get("completion")
    if prompt is None:
        raise ctx.missing("prompt")
    if completion is None:
        raise ctx.missing("completion")
    if isinstance(prompt, str) and isinstance(completion, str):
        return "completion", {"prompt": prompt, "completion": completion}
    if isinstance(prompt, (list, tuple)) and isinstance(completion, (list, tuple)):
        wheres: list[str] = []
        messages = _messages(prompt, "prompt", ctx, wheres=wheres) + \
            _messages(completion, "completion", ctx, wheres=wheres)
        _check_turns(messages, wheres, answer="completion")
        return "chat", {"messages": messages, "tools": _tools(ctx)}
    raise RowError(f"'prompt' is {_kind_of_value(prompt)} and 'completion' is {_kind_of_value(completion)}: "
                   "give both as strings (plain completion) or both as message lists (chat)", "wrong_type",
                   "completion")


def _preference(ctx: _Ctx, strings: bool) -> tuple[str, dict]:
    wheres: list[str] = []
    prompt = _system(ctx, wheres)
    prompt += _prompt(ctx.row.get("prompt"), "prompt", ctx, wheres)
    chosen, rejected = _pair(ctx, prompt, wheres)
    _distinct(chosen, rejected)
    return "preference", _pair_with_images(ctx, prompt, chosen, rejected)


def _sharegpt_preference(ctx: _Ctx, strings: bool) -> tuple[str, dict]:
    prompt, wheres = _conversation(ctx, "conversations", answer=False)
    chosen, rejected = _pair(ctx, prompt, wheres)
    _distinct(chosen, rejected)
    return "preference", _pair_with_images(ctx, prompt, chosen, rejected)


def _pair_with_images(ctx: _Ctx, prompt: list[dict], chosen: list[dict], rejected: list[dict]) -> dict:
    """A preference pair's columns; its images (if any) belong to the prompt, placed as in chat rows."""
    for field, answer in (("chosen", chosen), ("rejected", rejected)):
        if (ctx.images or ctx.row.get("images")) and any(_images.IMAGE in m["content"] for m in answer):
            raise RowError(f"{field!r} holds {_images.IMAGE}: a pair's images go in its prompt", "image_count", field)
    prompt, images = _with_images(ctx, prompt)
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected, **({"images": images} if images else {})}


def _implicit_preference(ctx: _Ctx, strings: bool) -> tuple[str, dict]:
    raw_c, raw_r = ctx.row.get("chosen"), ctx.row.get("rejected")
    for field, value in (("chosen", raw_c), ("rejected", raw_r)):
        if value is None:
            raise ctx.missing(field)
        if not isinstance(value, (list, tuple)):
            raise RowError(f"field {field!r} must be a whole conversation (a list of messages) when there is no "
                           f"'prompt', got {_kind_of_value(value)}; map the prompt with columns = "
                           "{ prompt = \"...\" }", "wrong_type", field)
    where_c: list[str] = []
    where_r: list[str] = []
    chosen = _messages(raw_c, "chosen", ctx, wheres=where_c)
    rejected = _messages(raw_r, "rejected", ctx, wheres=where_r)
    _check_turns(chosen, where_c)
    _check_turns(rejected, where_r)
    _distinct(chosen, rejected)
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if n == 0:
        raise RowError("'chosen' and 'rejected' share no leading messages, so there is no prompt to split off "
                       "(their first messages differ); give the prompt in its own field", "no_shared_prefix",
                       "chosen")
    for field, tail in (("chosen", chosen[n:]), ("rejected", rejected[n:])):
        if not tail:
            raise RowError(f"{field!r} ends where the other goes on (it is a prefix of it): there is no "
                           f"{field} answer", "no_answer", field)
        if tail[0]["role"] != "assistant" or any(m["role"] in ("user", "system") for m in tail):
            raise RowError(f"'chosen' and 'rejected' differ at message {n} ({tail[0]['role']} turn), before "
                           "the last assistant turn: only the final answer may differ", "differ_before_answer",
                           field)
    return "preference", {"prompt": chosen[:n], "chosen": chosen[n:], "rejected": rejected[n:]}


def _kto(ctx: _Ctx, strings: bool) -> tuple[str, dict]:
    label = _label(ctx, strings)
    row = ctx.row
    if _present(row, "completion"):
        wheres: list[str] = []
        prompt = _system(ctx, wheres)
        prompt += _prompt(row.get("prompt"), "prompt", ctx, wheres)
        completion = _answer(row.get("completion"), "completion", ctx, wheres)
        _check_turns(prompt + completion, wheres)
        return "unpaired_preference", {"prompt": prompt, "completion": completion, "label": label}
    field = "messages" if _present(row, "messages") else "conversations"
    if not _present(row, field):
        raise RowError(f"missing field 'messages' (or 'conversations', or 'prompt' + 'completion') "
                       f"(fields: {_fields(row)}); map it with columns = {{ messages = \"...\" }}",
                       "missing_field", "messages")
    messages, _ = _conversation(ctx, field, answer=False)
    if messages[-1]["role"] != "assistant":
        raise RowError(f"the last message of {field!r} must be the assistant's answer (the completion to label), "
                       f"got a {messages[-1]['role']} turn", "no_answer", field)
    if len(messages) < 2:
        raise RowError(f"{field!r} has only the answer, no prompt before it", "empty_conversation", field)
    return "unpaired_preference", {"prompt": messages[:-1], "completion": messages[-1:], "label": label}


def _text(ctx: _Ctx, strings: bool) -> tuple[str, dict]:
    text = ctx.string("text")
    if not text.strip():
        raise RowError("empty text", "empty_text", "text")
    return "text", {"text": text}


CONVERTERS = {
    "alpaca": _alpaca,
    "sharegpt": _sharegpt,
    "messages": _openai,
    "prompt_completion": _prompt_completion,
    "preference": _preference,
    "sharegpt_preference": _sharegpt_preference,
    "implicit_preference": _implicit_preference,
    "kto": _kto,
    "text": _text,
}


# LLaMA-Factory v1's preference rows: whole conversations under these names (read as implicit_preference).
FIELD_ALIASES = {"chosen_messages": "chosen", "rejected_messages": "rejected"}


def _aliased(row: dict) -> dict:
    """``row`` with :data:`FIELD_ALIASES` under our names, where ours are absent."""
    if not any(k in row for k in FIELD_ALIASES):
        return row
    out = dict(row)
    for theirs, ours in FIELD_ALIASES.items():
        if theirs in out and out.get(ours) is None:
            out[ours] = out.pop(theirs)
    return out


def apply_columns(row: Mapping, columns: Mapping[str, str]) -> dict:
    """Rename the file's fields to ours: ``columns`` maps our name -> the file's name. A field
    of the file that has our name but is not the mapped one gives way to the mapped one."""
    if not columns:
        return dict(row)
    theirs = set(columns.values())
    out = {k: v for k, v in row.items() if k not in columns or k in theirs}
    for ours, their in columns.items():
        out[ours] = row.get(their)
    for their in theirs - set(columns):
        out.pop(their, None)
    return out


def convert(row: Any, fmt: str = "auto", *, columns: Mapping[str, str] | None = None,
            strings: bool = False, placeholders: str = "allow", base: str | None = None) -> tuple[str, str, dict]:
    """Convert one raw row. Returns ``(format, kind, internal_row)``; raises :class:`RowError`.

    ``columns`` maps our field names to the row's (applied before detection). ``strings``
    says every value arrived as a string (CSV): then ``label`` may be ``"true"``/``"false"``.
    ``placeholders = "error"`` rejects message text holding an unfilled ``{{name}}``.
    Messages in the result carry only the keys they use; chat rows always have ``tools``
    (None when there are none).
    """
    fmt, kind, out, _ = convert_found(row, fmt, columns=columns, strings=strings, placeholders=placeholders, base=base)
    return fmt, kind, out


def convert_found(row: Any, fmt: str = "auto", *, columns: Mapping[str, str] | None = None,
                  strings: bool = False, placeholders: str = "allow",
                  base: str | None = None) -> tuple[str, str, dict, str | None]:
    """:func:`convert`, and with ``placeholders = "warn"`` the first placeholder the row's
    message text holds (``"'messages[1].content' holds '{{name}}'"``), else None."""
    if not isinstance(row, Mapping):
        raise RowError(f"expected an object with fields, got {_kind_of_value(row)}", "wrong_type", None)
    columns = columns or {}
    row = _aliased(apply_columns(row, columns))
    fmt = ALIASES.get(fmt, fmt)
    explicit = fmt != "auto"
    if not explicit:
        fmt = detect(row)
    elif fmt not in CONVERTERS:
        raise ValueError(f"unknown format {fmt!r}; formats: {', '.join(FORMAT_NAMES)}")
    ctx = _Ctx(row, columns, fmt, explicit, placeholders)
    ctx.base = base
    kind, out = CONVERTERS[fmt](ctx, strings)
    if not ctx.images_used and (ctx.images or ctx.row.get("images")):
        raise RowError(f"{fmt} rows with images are not read yet: images are read in chat rows (messages, ShareGPT "
                       "conversations) and preference pairs with a prompt", "unsupported_images", "images")
    found = None if ctx.placeholder is None else f"{ctx.placeholder[0]!r} holds {ctx.placeholder[1]!r}"
    return fmt, kind, out, found


def convert_kind(row: Any, fmt: str, kind: str | None, *, columns: Mapping[str, str] | None = None,
                 strings: bool = False, placeholders: str = "allow",
                 base: str | None = None) -> tuple[str, str, dict, str | None]:
    """:func:`convert_found`, where a row of another kind than ``kind`` (None: any) is a
    ``mixed_kind`` error: one source holds one kind of rows."""
    row_fmt, row_kind, converted, placeholder = convert_found(row, fmt, columns=columns, strings=strings,
                                                              placeholders=placeholders, base=base)
    if kind is not None and row_kind != kind:
        raise RowError(f"a {row_kind} row ({row_fmt}) among {kind} rows: one source holds one kind of "
                       "rows; split them into separate sources", "mixed_kind", None)
    return row_fmt, row_kind, converted, placeholder


def kind_of(row: Any, fmt: str = "auto", *, columns: Mapping[str, str] | None = None,
            strings: bool = False) -> str | None:
    """The kind a row converts to, or None when it does not convert."""
    try:
        return convert(row, fmt, columns=columns, strings=strings)[1]
    except RowError:
        return None


# -- batches -----------------------------------------------------------------------------------------

def _full_message(m: dict) -> dict:
    return {k: m.get(k) for k in MESSAGE_KEYS}


def _placeholder(kind: str) -> dict:
    return {c: None for c in KIND_COLUMNS[kind]}


def convert_rows(rows: Iterable[Mapping], fmt: str, kind: str, *, columns: Mapping[str, str] | None = None,
                 strings: bool = False, placeholders: str = "allow", base: str | None = None) -> dict[str, list]:
    """Convert rows to the columns of ``kind`` plus ``__error`` and ``__format`` (and, with
    ``placeholders = "warn"``, ``__placeholder``); a bad row (or one of another kind) gets
    None values and its error. Never raises for a row."""
    names = KIND_COLUMNS[kind]
    out: dict[str, list] = {c: [] for c in names}
    out[ERROR_COLUMN], out[FORMAT_COLUMN] = [], []
    found: list | None = out.setdefault(PLACEHOLDER_COLUMN, []) if placeholders == "warn" else None
    for row in rows:
        placeholder = None
        try:
            row_fmt, _, converted, placeholder = convert_kind(row, fmt, kind, columns=columns, strings=strings,
                                                              placeholders=placeholders, base=base)
            error = None
        except RowError as exc:
            converted, error, row_fmt = _placeholder(kind), exc.encode(), None
        for c in names:
            value = converted.get(c)
            if c in MESSAGE_COLUMNS and isinstance(value, list):
                value = [_full_message(m) for m in value]
            out[c].append(value)
        out[ERROR_COLUMN].append(error)
        out[FORMAT_COLUMN].append(row_fmt)
        if found is not None:
            found.append(placeholder if error is None else None)
    return out


def convert_batch(batch: Mapping[str, list], fmt: str, kind: str, columns: Mapping[str, str] | None = None,
                  strings: bool = False, placeholders: str = "allow", base: str | None = None) -> dict[str, list]:
    """:func:`convert_rows` for a ``datasets`` batch (a dict of equal-length lists)."""
    keys = list(batch)
    n = len(batch[keys[0]]) if keys else 0
    rows = ({k: batch[k][i] for k in keys} for i in range(n))
    return convert_rows(rows, fmt, kind, columns=columns, strings=strings, placeholders=placeholders, base=base)


def features(kind: str, messages_keys: Iterable[str] = MESSAGE_KEYS) -> dict:
    """``datasets`` feature types of a kind's columns (a plain dict of features)."""
    from datasets import List, Value

    message = {k: Value("int8") if k == "weight" else Value("string") for k in messages_keys}
    string = Value("string")
    return {
        "chat": {"messages": List(message), "tools": string, "images": List(string)},
        "completion": {"prompt": string, "completion": string},
        "preference": {"prompt": List(message), "chosen": List(message), "rejected": List(message),
                       "images": List(string)},
        "unpaired_preference": {"prompt": List(message), "completion": List(message), "label": Value("bool")},
        "text": {"text": string},
    }[kind]
