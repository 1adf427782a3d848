"""Where each assistant turn lies in a chat template's rendering, for any template.

Templates rewrite history: Qwen3 and QwQ drop ``<think>`` from earlier turns, gpt-oss drops the
analysis channel, Mistral moves the system prompt into the last user turn. So a turn is found in
the one rendering of the whole conversation, never by rendering prefixes of it:

1. render the conversation (``text``);
2. render it again with a marker (one private-use character per message) after each message's
   content. Deleting the markers must give ``text`` back exactly, so each marker is a position
   in ``text``: the end of that message's content. (A template that escapes or inspects a user's
   content changes with markers there; then only assistant contents are marked, and if that
   still changes the text the turn cannot be located.)
3. a turn starts where the model starts generating it: after the generation prompt the
   template renders after the previous message (that message's closing plus the assistant
   header, e.g. ``<|im_end|>\\n<|im_start|>assistant\\n``), matched right after that message's
   marker. A header the history renders shorter than the generation prompt (DeepSeek-R1's
   generation prompt ends with ``<think>\\n``, its history does not) is matched by its longest
   prefix ending at a token or a line;
   A turn with no content to mark (a tool call alone) is looked for before the next message's
   content only. When the generation prompt adds nothing (Command R7B renders the next header
   after every conversation), that header is matched by its longest prefix ending at a token
   (with thinking off it opens an empty thinking block a past answer lacks); a turn's reasoning
   it would cut is refused, naming ``enable_thinking``. When that fails, or an answer goes on in
   the block of the tool result before it (Apertus), the turn starts where the conversation
   rendered up to the previous message ends;
4. a turn ends with its end-of-turn token: the first of the template's end-of-turn tokens
   after the turn's content (and tool calls), with any end-of-turn tokens right after it: its
   declared ``stop_tokens``, the tokenizer's EOS, and those three probe renderings show (so
   ``native`` and a ``jinja`` file need none declared). A tool call its result follows in the same
   block ends where the conversation rendered up to the call ends;
5. a last turn the template leaves unclosed (GLM) gets the token that closes its turns
   (:meth:`SpanLocator.closing_token`), trained and counted (``closed_by_us``); a turn's
   reasoning the template does not render is refused, or counted (``dropped_reasoning``) with
   ``[template] dropped_reasoning = "warn"``.

docs/data.md explains the method and its limits.
"""

from __future__ import annotations

import re
from typing import Any

from ftcore.errors import FtcoreError

FIRST_MARK = 0xF0000  # Unicode plane 15, private use: never produced by a tokenizer or a template
LAST_MARK = 0xFFFFD
MARKS = re.compile("[\U000F0000-\U000FFFFD]")
# Markup that looks like one special token, for templates whose tokens the tokenizer lacks.
MARKUP = r"<\|[^<>|\s]+\|?>|<[^<>|\s]+\|>|<｜[^<>｜]+｜>|</s>|<eos>|<end_of_turn>|\[/?[A-Z_]+\]"


def template_title(template: Any) -> str:
    """How messages name a template: ``template 'chatml'``; a template read from a file names the
    file (``template 'jinja' (templates/r7b.jinja)``)."""
    title = getattr(template, "title", None)
    if isinstance(title, str) and title:
        return title
    return f"template '{getattr(template, 'name', None) or type(template).__name__}'"


class SpanError(FtcoreError):
    """An assistant turn that cannot be located in the template's rendering."""


class SpanLocator:
    """Finds assistant turns for one template and tokenizer; remembers what it learns across rows."""

    def __init__(self, template: Any, tokenizer: Any):
        self.template, self.tokenizer = template, tokenizer
        self.name = getattr(template, "name", type(template).__name__)
        self.title = template_title(template)
        specials = [str(t) for t in (getattr(tokenizer, "all_special_tokens", None) or [])]
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        # Added tokens marked special; Qwen's <tool_call> is added but not special, and closes no turn.
        specials += [str(t.content) for t in added.values() if getattr(t, "special", False)]
        specials = sorted({t for t in specials if t and not t.isspace()}, key=len, reverse=True)
        self.token = re.compile("|".join([*(re.escape(t) for t in specials), MARKUP]))
        self._ends: dict[bool, list[str]] = {}
        self._closing: dict[bool, str | None] = {}
        self._always_header: bool | None = None
        self._headers: dict[tuple[str, bool], str] = {}  # previous role -> generation prompt tail seen
        # Rows handled as the template cannot: counted for the data report.
        self.closed_by_us = 0  # last turns the template leaves unclosed, closed with closing_token()
        self.dropped_reasoning = 0  # turns trained without the reasoning the template does not render

    # -- rendering -----------------------------------------------------------------------------

    def render(self, messages: list[dict], tools: list | None, generation: bool = False) -> str:
        if tools:
            try:
                return self.template.render(messages, self.tokenizer, add_generation_prompt=generation, tools=tools)
            except TypeError as exc:
                if "tools" not in str(exc):
                    raise
                raise FtcoreError(f"{self.title} does not take tool schemas (this row has 'tools'); "
                                  "use a template that renders tools, e.g. \"native\" or a \"jinja\" file") from None
        return self.template.render(messages, self.tokenizer, add_generation_prompt=generation)

    # -- the method ------------------------------------------------------------------------------

    def locate(self, messages: list[dict], tools: list | None = None,
               turns: set[int] | None = None) -> tuple[str, list[tuple[int, int]]]:
        """``(text, spans)``: the conversation as the template renders it and, for each assistant
        message (or each index in ``turns``), the characters the model generates for it, from
        after its header to the end of its end-of-turn token."""
        text = self.render(messages, tools)
        if MARKS.search(text):
            raise SpanError("the conversation holds Unicode private-use characters of plane 15 "
                            "(U+F0000 to U+FFFFD), which mark turns while locating them; remove them")
        assistants = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        wanted = [i for i in assistants if turns is None or i in turns]
        if not wanted:
            return text, []
        marked_ids, positions = None, {}
        for ids in (range(len(messages)), assistants):
            marked = self.render(_marked(messages, ids), tools)
            if MARKS.sub("", marked) == text:
                marked_ids, positions = set(ids), _positions(marked)
                break
        if marked_ids is None:
            raise SpanError("the template renders a message differently when its text changes (it escapes or "
                            "tests the content), so turns cannot be located by marking them")
        spans, bound = [], 0
        for i in wanted:
            content_end = positions.get(i)
            start = self._start(messages, tools, i, text, positions, marked_ids, bound, content_end)
            end, closed = self._end(messages, tools, i, text, positions, start, content_end)
            for name in _called(messages[i]):
                if name not in text[start:end]:
                    raise SpanError(f"assistant turn {i} (message {i}) calls the tool {name!r}, but the template "
                                    "does not render tool calls, so the call would be dropped from training; use "
                                    "a template that renders them (e.g. \"native\" with a tool-calling model)")
            self._check_reasoning(messages, tools, i, text[start:end])
            if not closed and i == len(messages) - 1 and text[start:end].strip():
                # The template renders nothing after the conversation's last turn (GLM): the model would
                # never learn to stop on rows that end here. The token that closes its turns is added
                # (not after a turn the template renders empty: that answer is dropped, not unclosed).
                closing = self.closing_token(bool(tools))
                if closing:
                    text = text[:end] + closing + text[end:]
                    end += len(closing)
                    self.closed_by_us += 1
            spans.append((start, end))
            bound = end
        return text, spans

    # -- reasoning --------------------------------------------------------------------------------

    def _check_reasoning(self, messages: list[dict], tools: list | None, i: int, turn: str) -> None:
        """A turn's ``reasoning_content`` that the template does not render: refused, or with
        ``[template] dropped_reasoning = "warn"`` counted (``dropped_reasoning``) and trained without
        it. A template that drops the reasoning of earlier turns only (Qwen3 renders it for the
        turn being generated) keeps it where it matters: ``samples = "per_turn"`` trains it."""
        reasoning = messages[i].get("reasoning_content")
        if not isinstance(reasoning, str) or not reasoning.strip() or reasoning.strip() in turn:
            return
        if i < len(messages) - 1 and reasoning.strip() in self.render(messages[:i + 1], tools):
            return  # rendered when the turn is the last one: the template drops it from history only
        if _option(self.template, "dropped_reasoning", "error") == "warn":
            self.dropped_reasoning += 1
            return
        raise SpanError(f"assistant turn {i} (message {i}) has reasoning_content, but the template does not render "
                        "it, so the answer would be trained without its reasoning; use a template that renders "
                        "reasoning (e.g. \"native\" with a reasoning model), or set [template] dropped_reasoning = "
                        "\"warn\" to train the answers without it")

    def _start(self, messages, tools, i, text, positions, marked_ids, bound, content_end) -> int:
        prev = i - 1
        anchor = positions.get(prev)
        if content_end is not None:
            limit = content_end
        else:
            # A turn with no marker (a tool call with empty content): its header comes before the
            # next marked message's content, so the search stops there and never runs on to a
            # later turn's header.
            since = max(bound, anchor if anchor is not None else 0)
            later = [p for j, p in positions.items() if j > i and p > since]
            limit = min(later) if later else len(text)
        role = messages[prev].get("role", "") if prev >= 0 else ""
        if anchor is not None and anchor >= bound:
            seen = self._headers.get((role, bool(tools)))
            if seen is not None and text.startswith(seen, anchor) and anchor + len(seen) <= limit:
                return anchor + len(seen)
            prompt = self.render(_marked(messages[:i], marked_ids), tools, generation=True)
            mark = prompt.rfind(chr(FIRST_MARK + prev))
            header = MARKS.sub("", prompt[mark + 1:]) if mark >= 0 else None
            if header and text.startswith(header, anchor) and anchor + len(header) <= limit:
                self._headers[(role, bool(tools))] = header
                return anchor + len(header)
            if header and self.always_header():
                # The header every rendering ends with opens more than the history does (Command R7B ends
                # with <|CHATBOT_TOKEN|><|START_THINKING|><|END_THINKING|>, a past answer opens with
                # <|CHATBOT_TOKEN|><|START_RESPONSE|>): its longest prefix there, ending at a token.
                for candidate in self._prefixes(header):
                    if text.startswith(candidate, anchor) and anchor + len(candidate) <= limit:
                        start = anchor + len(candidate)
                        reasoning = messages[i].get("reasoning_content")
                        if isinstance(reasoning, str) and reasoning.strip() \
                                and text[start:limit].lstrip().startswith(reasoning.strip()):
                            # The prompt closes the reasoning empty (thinking off): the model would be trained
                            # to reason where it is never asked to, without the token that opens reasoning.
                            raise SpanError(
                                f"assistant turn {i} (message {i}) has reasoning_content, but with thinking off the "
                                f"template's generation prompt ends {header[len(candidate):]!r}, closing the "
                                "reasoning before the model writes any; turn thinking on with [template] "
                                "chat_template_kwargs = { enable_thinking = true } (Command R7B's variable), or "
                                "remove the reasoning")
                        return start
        # The previous message renders differently when it is the last one (a template that closes
        # the last tool result differently), or there is no marker before this turn: the text the
        # generation prompt adds, searched from the end of the previous turn. A history that renders
        # the header shorter than the generation prompt (DeepSeek-R1's ends with "<think>\n") is
        # matched by its longest prefix that ends at a token or a line. The search is confined to the
        # text between the previous message and this turn's content.
        prefix = messages[:i]
        with_prompt = self.render(prefix, tools, generation=True) if prefix else self._empty_prompt(tools)
        without = self.render(prefix, tools) if prefix else ""
        generation = with_prompt[_common_prefix(with_prompt, without):]
        since = max(bound, anchor if anchor is not None else 0)
        for candidate in self._prefixes(generation):
            found = text.find(candidate, since, limit)
            if found >= 0:
                return found + len(candidate)
        # The generation prompt adds nothing (Command R7B renders the next assistant header after every
        # conversation, asked or not), or this answer goes on in the block of the tool result before it
        # (Apertus: call, tool output and answer in one assistant block): the turn starts where the
        # conversation rendered up to the previous message stops matching this one.
        if prefix and (not generation.strip() or role == "tool"):
            cut = _common_prefix(without, text)
            if since <= cut <= limit and cut == len(without):
                return cut
        raise SpanError(f"assistant turn {i} (message {i}): its header, the template's generation prompt "
                        f"{generation!r}, is not in the rendered conversation")

    def _empty_prompt(self, tools) -> str:
        try:
            return self.render([], tools, generation=True)
        except Exception:
            raise SpanError("the conversation starts with an assistant turn, and the template cannot render a "
                            "generation prompt for an empty conversation to locate it") from None

    def _end(self, messages, tools, i, text, positions, start, content_end) -> tuple[int, bool]:
        """Where turn ``i`` ends, and whether an end-of-turn token (or the markup of the message after
        it) closes it; ``False``: the template renders nothing after it."""
        after = max(start, content_end if content_end is not None else start)
        later = [p for j, p in positions.items() if j > i and p >= after]
        limit = min(later) if later else len(text)
        ends = self.end_tokens(bool(tools))
        best = None
        for token in ends:
            found = text.find(token, after, limit)
            if found >= 0 and (best is None or found < best[0]):
                best = (found, found + len(token))
        if best is not None:
            end = best[1]
            # A closing of several end tokens in a row (Command R7B's <|END_RESPONSE|><|END_OF_TURN_TOKEN|>):
            # the model generates them all before it stops.
            while (following := next((t for t in ends if text.startswith(t, end)), None)) is not None:
                end += len(following)
            return end, True
        if i < len(messages) - 1 and messages[i].get("tool_calls") and messages[i + 1].get("role") == "tool":
            # A tool call followed by its result with no end-of-turn token between (the result goes on
            # in the same assistant block, as Apertus renders it): the turn is what the template renders
            # when the call ends the conversation, and the markup right after it, if any (GLM's
            # <|observation|> after a tool call, which the model generates to stop).
            cut = self._alone(messages, tools, i, text)
            if cut is not None and after <= cut <= limit:
                gap = len(text[cut:limit]) - len(text[cut:limit].lstrip())
                following = self.token.match(text, cut + gap, limit)
                return (following.end(), True) if following is not None else (cut, True)
        following = self.token.search(text, after, limit)
        if following is not None and later:
            # No declared end, but the turn is followed by another message: the markup that
            # starts it ends this turn (GLM's <|observation|> after a tool call).
            return following.end(), True
        if not text[after:limit].strip():
            return after, False  # a template that closes turns with nothing (GLM's last turn)
        raise SpanError(f"assistant turn {i} (message {i}): no end-of-turn token "
                        f"({', '.join(map(repr, ends)) or 'none known'}) follows it; "
                        "declare the template's end-of-turn token with [template] stop_tokens")

    def _alone(self, messages, tools, i, text) -> int | None:
        """Where the conversation rendered up to turn ``i`` (as its last message) ends in the whole
        conversation ``text``; None when that rendering is not a start of it."""
        try:
            alone = self.render(messages[:i + 1], tools)
        except Exception:
            return None
        return len(alone) if text.startswith(alone) else None

    def _prefixes(self, header: str) -> list[str]:
        """``header``, then its prefixes that end at a token, a line or a closing bracket, longest
        first; never empty or only whitespace."""
        cuts = {len(header)}
        cuts.update(m.end() for m in self.token.finditer(header))
        cuts.update(k + 1 for k, c in enumerate(header) if c in "\n>]")
        out = [header[:k] for k in sorted(cuts, reverse=True) if header[:k].strip()]
        return out or ([header] if header else [])

    # -- end-of-turn tokens ----------------------------------------------------------------------

    def end_tokens(self, tools: bool = False) -> list[str]:
        """The tokens that can close an assistant turn: the template's declared stop tokens, those its
        rendering shows (gpt-oss closes history turns with <|end|> but stops generating at <|return|>)
        and the tokenizer's EOS."""
        if tools in self._ends:
            return self._ends[tools]
        declared = [str(t) for t in getattr(self.template, "stop_tokens", ()) or ()]
        eos = getattr(self.tokenizer, "eos_token", None)
        ends = list(dict.fromkeys([*declared, *self._probe(tools), *([str(eos)] if eos else [])]))
        self._ends[tools] = ends
        return ends

    def closing_token(self, tools: bool = False) -> str | None:
        """The token to add after a last turn the template leaves unclosed: the declared end of turn,
        else the markup the template closes an assistant turn with when a user turn follows (GLM's
        <|user|>), else the tokenizer's EOS."""
        declared = [str(t) for t in getattr(self.template, "stop_tokens", ()) or ()]
        if declared:
            return declared[0]
        self.end_tokens(tools)  # probes the template
        eos = getattr(self.tokenizer, "eos_token", None)
        return self._closing.get(tools) or (str(eos) if eos else None)

    def always_header(self) -> bool:
        """Whether the template renders the next assistant header after every conversation, asked
        for a generation prompt or not (Command R7B): then it ends every rendering, after the last
        turn's closing too."""
        if self._always_header is None:
            probe = [{"role": "user", "content": chr(LAST_MARK)}]
            try:
                self._always_header = self.render(probe, None, generation=True) == self.render(probe, None)
            except Exception:
                self._always_header = False
        return self._always_header

    def _probe(self, with_tools: bool = False) -> list[str]:
        """End-of-turn tokens as the template renders them: the markup closing an assistant turn
        that ends the conversation (its last token), one followed by a user turn (its first), and
        a tool call that ends the conversation (its last token). A template that renders the next
        header after every conversation puts that header last: then the first token counts, through
        the token that closes a user turn when it follows."""
        always = self.always_header()
        u, a, u2 = (chr(LAST_MARK - k) for k in range(3))
        call = {"type": "function", "function": {"name": "ftcore_probe", "arguments": {"q": a}}}
        tool = {"type": "function", "function": {"name": "ftcore_probe", "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}
        probes = (([{"role": "user", "content": u}, {"role": "assistant", "content": a}], None, True),
                  ([{"role": "user", "content": u}, {"role": "assistant", "content": a},
                    {"role": "user", "content": u2}], None, False),
                  ([{"role": "user", "content": u}, {"role": "assistant", "content": "", "tool_calls": [call]}],
                   [tool], True))
        found = []
        for messages, tools, last in probes:
            rendered = None
            for schemas in (tools, [tool]):  # a tool-use template may need a tools list even to render a chat
                try:
                    rendered = self.render(messages, schemas)
                    break
                except Exception:
                    continue
            if rendered is None or a not in rendered:
                continue
            tail = rendered.split(a, 1)[-1].split(u2, 1)[0]
            tokens = [m.group() for m in self.token.finditer(tail)]
            if tokens:
                found.append(tokens[-1] if last and not always else tokens[0])
                if always:
                    # The next header follows the closing, so the closing's last token is not the tail's: it
                    # runs on to the token that closes a user turn too (Command R7B's <|END_RESPONSE|> then
                    # <|END_OF_TURN_TOKEN|>), which the model must learn to generate before it stops.
                    user_closing = next(self.token.finditer(rendered.split(u, 1)[-1].split(a, 1)[0]), None)
                    if user_closing is not None and user_closing.group() in tokens:
                        found += tokens[1:tokens.index(user_closing.group()) + 1]
                if not last:
                    self._closing[with_tools] = tokens[0]
        return list(dict.fromkeys(found))


def _called(message: dict) -> list[str]:
    """The names of the tools an assistant message calls."""
    names = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", call) if isinstance(call, dict) else {}
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            names.append(function["name"])
    return names


def _marked(messages: list[dict], ids: Any) -> list[dict]:
    """``messages`` with a marker after each chosen message's content (before its trailing
    whitespace, so a template that strips content strips the same)."""
    ids = set(ids)
    out = []
    for j, m in enumerate(messages):
        content = m.get("content")
        if j in ids and isinstance(content, str) and content.strip():
            core = content.rstrip()
            m = {**m, "content": core + chr(FIRST_MARK + j) + content[len(core):]}
        out.append(m)
    return out


def _positions(marked: str) -> dict[int, int]:
    """message index -> where its marker stands in the unmarked text (the last one, if repeated)."""
    out, removed = {}, 0
    for match in MARKS.finditer(marked):
        out[ord(match.group()) - FIRST_MARK] = match.start() - removed
        removed += 1
    return out


def _common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of ``a`` and ``b`` (by bisection: slices compare in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n - 1  # a[:lo] == b[:lo]; a[:hi + 1] != b[:hi + 1]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _option(template: Any, name: str, default: Any) -> Any:
    return getattr(getattr(template, "options", None), name, default)
