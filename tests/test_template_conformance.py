"""Conformance of assistant-turn location on the 18 official chat templates in ../shared/fixtures/templates.

For every template and conversation kind, the characters ftcore labels (``jinja`` with the template file, and
``native`` with the template as the tokenizer's own) must be exactly the assistant parts of the official
rendering plus their end-of-turn token. The expected parts come from an independent source: a hand-written
description of each family's format (the text that opens an assistant turn and the tokens that close it),
applied to the rendering with regular expressions. ftcore's method (markers and generation prompts,
plugins/common/spans.py) shares no code with it.

``python -m pytest tests/test_template_conformance.py -k table -s`` prints the template x conversation table.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest

from ftcore.errors import FtcoreError

SHARED = Path(__file__).resolve().parents[2] / "shared" / "fixtures"
TEMPLATES = SHARED / "templates"
pytestmark = pytest.mark.skipif(not TEMPLATES.is_dir(), reason="../shared/fixtures/templates is absent")

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = {"id": "abc123XYZ", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}


def u(text):
    return {"role": "user", "content": text}


def a(text, **extra):
    return {"role": "assistant", "content": text, **extra}


CONVERSATIONS = {
    "single": ([u("Hi there"), a("Hello! How can I help?")], None),
    "system": ([{"role": "system", "content": "Be brief."}, u("Hi there"), a("Hello.")], None),
    "multi-turn": ([u("One?"), a("First answer."), u("Two?"), a("Second answer.")], None),
    "system, multi-turn": ([{"role": "system", "content": "Be brief."}, u("One?"), a("First."), u("Two?"),
                            a("Second.")], None),
    "tools": ([u("Weather in Paris?"), a("", tool_calls=[CALL]),
               {"role": "tool", "tool_call_id": "abc123XYZ", "name": "get_weather", "content": '{"temp": 21}'},
               a("It is 21 degrees in Paris.")], TOOLS),
    "reasoning field": ([u("One?"), a("First.", reasoning_content="think one"), u("Two?"),
                         a("Second.", reasoning_content="think two")], None),
    "reasoning inline": ([u("One?"), a("<think>\nthink one\n</think>\n\nFirst."), u("Two?"),
                          a("<think>\nthink two\n</think>\n\nSecond.")], None),
    "ends with user": ([u("One?"), a("First."), u("Two?")], None),
}
CONVERSATIONS["tool calls, no schemas"] = (CONVERSATIONS["tools"][0], None)

# Each family's format, written from its documentation and rendering, independently of ftcore:
# what opens an assistant turn (the model generates what follows) and what closes one.
CHATML = (r"<\|im_start\|>assistant\n", r"<\|im_end\|>")
FORMATS = {
    "Qwen-Qwen2.5-7B-Instruct": CHATML,
    "Qwen-Qwen3-0.6B": CHATML,
    "Qwen-QwQ-32B": (r"<\|im_start\|>assistant\n(?:<think>\n)?", r"<\|im_end\|>"),  # its prompt opens the think
    "HuggingFaceTB-SmolLM3-3B": CHATML,
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": CHATML,
    "moonshotai-Kimi-K2": (r"<\|im_assistant\|>assistant<\|im_middle\|>", r"<\|im_end\|>"),
    "meta-llama-Llama-3.1-8B-Instruct": (r"<\|start_header_id\|>assistant<\|end_header_id\|>\n\n", r"<\|eot_id\|>"),
    "meta-llama-Llama-3.3-70B-Instruct": (r"<\|start_header_id\|>assistant<\|end_header_id\|>\n\n", r"<\|eot_id\|>"),
    # Mistral closes a turn with the tokenizer's EOS, whatever it is.
    "mistralai-Mistral-Nemo-Instruct-2407": (r"\[/INST\]|\[/TOOL_RESULTS\]", "{eos}"),
    "Mistral-Small-3.2-24B-Instruct-2506": (r"\[/INST\]|\[/TOOL_RESULTS\]", "{eos}"),
    "microsoft-Phi-3.5-mini-instruct": (r"<\|assistant\|>\n", r"<\|end\|>"),
    "google-gemma-2-2b-it": (r"<start_of_turn>model\n", r"<end_of_turn>"),
    # Gemma 4 answers after a tool result inside the same model turn; a tool call ends at <|tool_response>.
    "google-gemma-4-31B-it": (r"<\|turn>model\n|<tool_response\|>", r"<turn\|>|<\|tool_response>"),
    # R1 renders an empty "<｜Assistant｜><｜end▁of▁sentence｜>" after a tool call: not a turn.
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": (r"<｜Assistant｜>(?!<｜end▁of▁sentence｜>)|<｜tool▁outputs▁end｜>",
                                                 r"<｜end▁of▁sentence｜>"),
    "deepseek-ai-DeepSeek-V3.1": (r"<｜Assistant｜>(?:<think></think>)?|<｜tool▁output▁end｜>", r"<｜end▁of▁sentence｜>"),
    "ibm-granite-granite-3.3-2B-Instruct": (r"<\|start_of_role\|>assistant<\|end_of_role\|>", r"<\|end_of_text\|>"),
    # GLM closes no turn: the next role token (or the end of the text) does.
    "GLM-4.6": (r"<\|assistant\|>", r"<\|user\|>|<\|observation\|>|\Z"),
    # gpt-oss (harmony): a turn may be several assistant messages (analysis, then final); see _harmony_parts.
    "openai-gpt-oss-120b": None,
}


def expected_parts(name: str, text: str, eos: str) -> list[str]:
    """The assistant parts of ``text`` by the family's format: from after each opening to the end
    of the first closing after it."""
    if name == "openai-gpt-oss-120b":
        return _harmony_parts(text)
    opening, closing = (re.compile(p.replace("{eos}", re.escape(eos))) for p in FORMATS[name])
    parts, pos = [], 0
    while (start := opening.search(text, pos)) is not None:
        if start.end() == len(text):
            break  # Mistral closes a last user turn with [/INST]: an opening nothing follows
        end = closing.search(text, start.end())
        assert end is not None, (name, text[start.start():])
        parts.append(text[start.end():end.end()])
        pos = end.end()
    return parts


def _harmony_parts(text: str) -> list[str]:
    """gpt-oss (harmony): messages are <|start|>{header}<|message|>...(<|end|>|<|return|>|<|call|>); a turn is a
    run of consecutive assistant messages, trained from after the first "<|start|>assistant"."""
    messages = re.findall(r"<\|start\|>(.*?)(<\|end\|>|<\|return\|>|<\|call\|>)", text, flags=re.S)
    parts, current = [], None
    for body, close in messages:
        if body.startswith("assistant"):
            piece = body[len("assistant"):] + close
            current = piece if current is None else current + "<|start|>assistant" + piece
            if close in ("<|return|>", "<|call|>") or "<|channel|>final" in body:
                parts.append(current)
                current = None
        elif current is not None:
            parts.append(current)
            current = None
    if current is not None:
        parts.append(current)
    return parts


@pytest.fixture(scope="module")
def tokenizer():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(SHARED / "tokenizers" / "qwen3")


def template_for(kind: str, path: Path, tokenizer, **options):
    """(template component, tokenizer) as a plan would make them: [template] use = "jinja" with the
    file, or "native" with the file as the tokenizer's own chat template; ``options``: the template's
    other options (``chat_template_kwargs``)."""
    from ftcore_plugins.templates.jinja import JinjaFileTemplate
    from ftcore_plugins.templates.native import NativeTemplate

    if kind == "jinja":
        return JinjaFileTemplate(JinjaFileTemplate.Options(path=str(path), **options)), tokenizer
    if path not in _OWN:  # a deep copy of a 151k-token tokenizer takes a while: one per template
        _OWN[path] = copy.deepcopy(tokenizer)
        _OWN[path].chat_template = path.read_text(encoding="utf-8")
    return NativeTemplate(NativeTemplate.Options(**options)), _OWN[path]


_OWN: dict[Path, object] = {}


def check(name: str, kind: str, conversation: str, tokenizer) -> str:
    """'pass', or 'refused: ...' when the official template itself refuses the conversation;
    raises AssertionError on a mismatch."""
    from ftcore_plugins.common.chat import render_with_spans
    from transformers.utils.chat_template_utils import render_jinja_template

    path = TEMPLATES / f"{name}.jinja"
    messages, tools = CONVERSATIONS[conversation]
    source = path.read_text(encoding="utf-8")
    if tools and not re.search(r"\btools\b", source):
        # The template has no `tools` variable (SmolLM3 reads `xml_tools`): the schemas would be dropped
        # silently, so ftcore refuses the row.
        template, tok = template_for(kind, path, tokenizer)
        with pytest.raises(FtcoreError, match="does not render tool schemas"):
            render_with_spans(template, messages, tok, tools)
        return "refused: the template takes no `tools`"
    try:  # the official rendering, by transformers alone
        official = render_jinja_template([messages], tools=tools, chat_template=source,
                                         **tokenizer.special_tokens_map)[0][0]
    except Exception as exc:
        template, tok = template_for(kind, path, tokenizer)
        with pytest.raises(FtcoreError) as refused:
            render_with_spans(template, messages, tok, tools)
        assert "\n" not in str(refused.value)
        return f"refused by the template: {str(exc).splitlines()[0][:60]}"
    if any(m.get("tool_calls") for m in messages) and "tool_calls" not in source:
        # The template renders no tool calls (Phi-3.5, granite): the call would vanish from training.
        template, tok = template_for(kind, path, tokenizer)
        with pytest.raises(FtcoreError, match="does not render tool calls"):
            render_with_spans(template, messages, tok, tools)
        return "refused: the template takes no `tool_calls`"
    dropped = [k for k, m in enumerate(messages) if m.get("reasoning_content") and m["reasoning_content"] not in
               render_jinja_template([messages[:k + 1]], tools=tools, chat_template=source,
                                     **tokenizer.special_tokens_map)[0][0]]
    if dropped:
        # The template renders no reasoning_content, even for the turn being generated (Llama, Mistral, ...):
        # the reasoning would vanish from training, so the row is refused (dropped_reasoning = "warn" trains it).
        template, tok = template_for(kind, path, tokenizer)
        with pytest.raises(FtcoreError, match="has reasoning_content, but the template does not render it"):
            render_with_spans(template, messages, tok, tools)
        return "refused: the template drops `reasoning_content`"
    if name == "GLM-4.6" and messages[-1]["role"] == "assistant":
        # GLM renders nothing after the last turn; ftcore adds the token that closes its turns in history
        # (<|user|>, one of GLM's stop tokens), so that rows ending there teach the model to stop.
        official += "<|user|>"
    template, tok = template_for(kind, path, tokenizer)
    text, spans = render_with_spans(template, messages, tok, tools)
    assert text == official
    got = [text[i:j] for i, j in spans]
    assert got == expected_parts(name, official, tokenizer.eos_token), (name, kind, conversation)
    return "pass"


NAMES = sorted(p.stem for p in TEMPLATES.glob("*.jinja")) if TEMPLATES.is_dir() else []


def test_every_fixture_template_has_a_format_description():
    assert len(NAMES) == 18 and set(NAMES) == set(FORMATS)


@pytest.mark.parametrize("kind", ["jinja", "native"])
@pytest.mark.parametrize("name", NAMES)
def test_labelled_characters_are_the_official_assistant_parts(name, kind, tokenizer):
    results = {c: check(name, kind, c, tokenizer) for c in CONVERSATIONS}
    # A template may refuse a kind of conversation (Gemma 2 has no system role), never a plain chat.
    assert results["single"] == "pass" or name.endswith("tool_use"), results
    assert results["multi-turn"] == "pass" or name.endswith("tool_use"), results


def test_table(tokenizer, capsys):
    """The conformance table (docs/data.md), for ``jinja``; ``native`` is checked above."""
    rows = ["| template | " + " | ".join(CONVERSATIONS) + " |", "|---" * (len(CONVERSATIONS) + 1) + "|"]
    for name in NAMES:
        cells = []
        for conversation in CONVERSATIONS:
            try:
                result = check(name, "jinja", conversation, tokenizer)
            except AssertionError:
                result = "FAIL"
            cells.append("pass" if result == "pass" else "FAIL" if result == "FAIL"
                         else "refused¹" if "takes no" in result or "drops" in result else "refused²")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    with capsys.disabled():
        print("\n" + "\n".join(rows))
    assert not any("FAIL" in r for r in rows)
