"""Kinds of chat templates that real models ship and that span location once refused (issue 30,
section 2), each as a template written here that behaves like the family:

* a tool-call turn with empty content, where the generation prompt opens more than the history
  renders (Qwen3's no-think mode writes an empty think block in the prompt, not before a call);
* an answer that goes on in the assistant block of the tool result before it (Swiss AI's Apertus);
* nothing rendered after the conversation's last turn (GLM), so the end-of-turn token is added;
* reasoning the template does not render (refused, or counted with ``dropped_reasoning = "warn"``);
* ``mistral-v3`` rows with tool results, whose ``tool_call_id`` the data layer must keep.

And one family as the model ships it: Cohere's Command R7B, its official template (llama.cpp's copy,
which ``python -m ftcore_plugins.exporters.llama_cpp_converter`` keeps; skipped without it) with a real
tokenizer from ../shared/fixtures. It renders the next assistant header after every conversation, asked
for or not, and with thinking off (its default) that header opens more than a past turn does (issue 45).

For each, the trained characters are compared with a description of the format written by hand
(what the model generates for each turn, literally), and a tiny model trains on such rows.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ftcore.errors import FtcoreError
from ftcore_plugins.exporters.llama_cpp_converter import FETCH, official_template

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = {"id": "abc123XYZ", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}


def u(text):
    return {"role": "user", "content": text}


def a(text, **extra):
    return {"role": "assistant", "content": text, **extra}


def tool(text):
    return {"role": "tool", "tool_call_id": "abc123XYZ", "name": "get_weather", "content": text}


SINGLE = [u("Hi there"), a("Hello!")]
MULTI = [u("One?"), a("First."), u("Two?"), a("Second.")]
WEATHER = [u("Weather in Paris?"), a("", tool_calls=[CALL]), tool("21C"), a("It is 21C in Paris.")]

# Qwen3 in no-think mode, reduced: the generation prompt ends with an empty think block, which the
# history renders before an answer but not before a tool call with no content.
NO_THINK = (
    "{%- if tools %}{{- '<|im_start|>system\\nTools: ' + (tools | map(attribute='function.name') | join(', ')) + "
    "'<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if m.content %}{{- '<think>\\n\\n</think>\\n\\n' + m.content }}{%- endif %}"
    "{%- for c in m.tool_calls or [] %}{{- '<tool_call>' + c.function.name + ' ' + (c.function.arguments | tojson)"
    " + '</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}{%- endif %}")

# Apertus, reduced: the call, the tool's output and the answer are one assistant block; the generation
# prompt always opens a new block.
ONE_BLOCK = (
    "{{- '<|system_start|>You are Apertus.' }}"
    "{%- if tools %}{{- ' Tools: ' + (tools | map(attribute='function.name') | join(', ')) }}{%- endif %}"
    "{{- '<|system_end|>' }}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{- '<|user_start|>' + m.content + '<|user_end|>' }}"
    "{%- elif m.role == 'assistant' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|assistant_start|>' }}{%- endif %}"
    "{{- m.content }}"
    "{%- if m.tool_calls %}{{- '<|tools_prefix|>[' }}{%- for c in m.tool_calls %}{{- '{\"' + c.function.name + "
    "'\": ' + (c.function.arguments | tojson) + '}' }}{%- endfor %}{{- ']<|tools_suffix|>' }}"
    "{%- else %}{{- '<|assistant_end|>' }}{%- endif %}"
    "{%- elif m.role == 'tool' %}{{- '[' + (m.content | tojson(true)) + ']' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant_start|>' }}{%- endif %}")

# GLM, reduced: a role token opens each message and nothing closes one; the next message's token ends a
# turn (<|observation|> after a tool call), and nothing follows the conversation's last turn.
UNCLOSED = (
    "{{- '[gMASK]' }}{%- if tools %}{{- '<|system|>\\nTools: ' + (tools | map(attribute='function.name') | "
    "join(', ')) }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}{{- '<|observation|>\\n' + m.content }}"
    "{%- else %}{{- '<|' + m.role + '|>\\n' + m.content }}"
    "{%- for c in m.tool_calls or [] %}{{- '<tool_call>' + c.function.name + '</tool_call>' }}{%- endfor %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}")

# name -> (template text, [template] options, {conversation: the characters trained, by hand})
CLASSES = {
    "no-think": (NO_THINK, {"stop_tokens": ["<|im_end|>"], "special_tokens": ["<|im_start|>"]}, {
        "single": ["Hello!<|im_end|>"],
        "weather": ['<tool_call>get_weather {"city": "Paris"}</tool_call><|im_end|>', "It is 21C in Paris.<|im_end|>"],
    }),
    "one-block": (ONE_BLOCK, {"special_tokens": [
        "<|system_start|>", "<|system_end|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>",
        "<|assistant_end|>", "<|tools_prefix|>", "<|tools_suffix|>"]}, {
        "single": ["Hello!<|assistant_end|>"],
        "multi": ["First.<|assistant_end|>", "Second.<|assistant_end|>"],
        "weather": ['<|tools_prefix|>[{"get_weather": {"city": "Paris"}}]<|tools_suffix|>',
                    "It is 21C in Paris.<|assistant_end|>"],
    }),
    "unclosed": (UNCLOSED, {"special_tokens": ["[gMASK]", "<|system|>", "<|user|>", "<|assistant|>",
                                               "<|observation|>"]}, {
        "single": ["Hello!<|user|>"],
        "multi": ["First.<|user|>", "Second.<|user|>"],
        "weather": ["<tool_call>get_weather</tool_call><|observation|>", "It is 21C in Paris.<|user|>"],
    }),
}
CONVERSATIONS = {"single": (SINGLE, None), "multi": (MULTI, None), "weather": (WEATHER, TOOLS)}


def jinja(tmp_path, text: str, **options):
    from ftcore_plugins.templates.jinja import JinjaFileTemplate

    path = tmp_path / "chat.jinja"
    path.write_text(text, encoding="utf-8")
    return JinjaFileTemplate(JinjaFileTemplate.Options(path=str(path), **options))


def trained(template, messages, tools=None, tokenizer=None) -> tuple[str, list[str]]:
    from ftcore_plugins.common.chat import render_with_spans

    text, spans = render_with_spans(template, messages, tokenizer, tools)
    return text, [text[i:j] for i, j in spans]


@pytest.mark.parametrize("name", list(CLASSES))
def test_the_trained_characters_are_the_formats_assistant_parts(name, tmp_path):
    text, options, expected = CLASSES[name]
    template = jinja(tmp_path, text, **options)
    for conversation, parts in expected.items():
        messages, tools = CONVERSATIONS[conversation]
        assert trained(template, messages, tools)[1] == parts, (name, conversation)


def test_the_empty_tool_call_turn_no_longer_runs_on_to_the_answers_header(tmp_path):
    """Before: the header search for the call (no content, so no marker) ran on to the answer's header."""
    template = jinja(tmp_path, NO_THINK, stop_tokens=["<|im_end|>"])
    text, parts = trained(template, WEATHER, TOOLS)
    call = text.index("<tool_call>")
    assert text[call - len("<|im_start|>assistant\n"):call] == "<|im_start|>assistant\n"  # the call's own header
    assert parts[0].startswith("<tool_call>") and "It is" not in parts[0]


def test_unclosed_last_turns_get_the_closing_token_and_the_data_report_counts_them(tmp_path, monkeypatch):
    import datasets

    from ftcore.testing import RecordingReporter
    from ftcore_plugins.common.chat import encode
    from ftcore_plugins.common.prepare import prepare

    monkeypatch.chdir(tmp_path)  # messages name the template file relative to the working folder
    template = jinja(tmp_path, UNCLOSED)
    text, parts = trained(template, SINGLE)
    assert text == "[gMASK]<|user|>\nHi there<|assistant|>\nHello!<|user|>" and parts == ["Hello!<|user|>"]
    # A declared end of turn is what is added.
    assert trained(jinja(tmp_path, UNCLOSED, stop_tokens=["<|endoftext|>"]), SINGLE)[1] == ["Hello!<|endoftext|>"]
    rows = datasets.Dataset.from_list([{"messages": SINGLE}, {"messages": MULTI}])
    tok = _tokenizer(tmp_path)
    _, stats = encode(rows, tok, template, max_length=None)
    assert stats.end_token_added == 2
    reporter = RecordingReporter()
    prepared = prepare(rows, tok, template, max_length=None, reporter=reporter, use_cache=False, where="data.chat")
    assert prepared.stats["end_token_added"] == 2
    assert reporter.warnings == [
        "data.chat: template 'jinja' (chat.jinja) renders no end-of-turn token after a conversation's last turn; "
        "'<|user|>' was added after 2 such turn(s) and trained, so that the model learns to stop; declare it with "
        "[template] stop_tokens = ['<|user|>'] so that generation stops there too"]


def test_reasoning_the_template_does_not_render_is_refused_or_counted(tmp_path):
    import datasets

    from ftcore_plugins.common.chat import encode
    from ftcore_plugins.templates.chatml import ChatMLTemplate

    rows = datasets.Dataset.from_list([{"messages": [u("Hi"), a("Hello.", reasoning_content="Greet back.")]},
                                       {"messages": SINGLE}])
    tok = _tokenizer(tmp_path)
    with pytest.raises(FtcoreError) as refused:
        encode(rows, tok, ChatMLTemplate(), max_length=None, where="data.chat (chat.jsonl)")
    assert str(refused.value).startswith(
        "data.chat (chat.jsonl), row 1: template 'chatml': assistant turn 1 (message 1) has reasoning_content, but "
        "the template does not render it, so the answer would be trained without its reasoning; use a template "
        "that renders reasoning")
    _, stats = encode(rows, tok, ChatMLTemplate(ChatMLTemplate.Options(dropped_reasoning="warn")), max_length=None)
    assert (stats.kept, stats.reasoning_dropped) == (2, 1)
    # A template that renders reasoning only for the turn being generated (Qwen3) drops it from history by
    # design: the conversation trains, and samples = "per_turn" trains every turn's reasoning.
    history = (
        "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}"
        "{%- if m.reasoning_content and loop.last %}{{- '<think>' + m.reasoning_content + '</think>' }}{%- endif %}"
        "{{- m.content + '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    conversation = [u("One?"), a("First.", reasoning_content="r1"), u("Two?"), a("Second.", reasoning_content="r2")]
    assert trained(jinja(tmp_path, history), conversation)[1] == ["First.<|im_end|>",
                                                                  "<think>r2</think>Second.<|im_end|>"]


def test_a_refusal_names_the_template_file(tmp_path, monkeypatch):
    import datasets

    from ftcore_plugins.common.chat import encode

    monkeypatch.chdir(tmp_path)
    (tmp_path / "templates").mkdir()
    path = tmp_path / "templates" / "strict.jinja"
    path.write_text("{{ raise_exception('no') }}", encoding="utf-8")
    from ftcore_plugins.templates.jinja import JinjaFileTemplate

    template = JinjaFileTemplate(JinjaFileTemplate.Options(path=str(path)))
    with pytest.raises(FtcoreError) as refused:
        encode(datasets.Dataset.from_list([{"messages": SINGLE}]), _tokenizer(tmp_path), template, max_length=None,
               where="data.chat")
    assert str(refused.value).startswith("data.chat, row 1: template 'jinja' (templates/strict.jinja) cannot render "
                                         "this conversation: no")


def test_mistral_v3_keeps_tool_call_ids_from_the_file_and_trains_calls_and_answers(tmp_path):
    """The data layer keeps `tool_call_id` (before, it was dropped and every row with a tool result was refused:
    "Tool call IDs should be alphanumeric strings with length 9!")."""
    from test_sources import load_data

    from ftcore_plugins.common.chat import render_with_spans, row_tools
    from ftcore_plugins.templates.mistral_v3 import MistralV3Template

    (tmp_path / "tools.jsonl").write_text(json.dumps({"messages": WEATHER, "tools": TOOLS}) + "\n" +
                                          json.dumps({"messages": SINGLE}) + "\n", encoding="utf-8")
    rows = load_data(tmp_path, 'use = "jsonl"\npath = "tools.jsonl"\n', "chat").ds
    row = rows[0]
    assert row["messages"][2]["tool_call_id"] == "abc123XYZ"
    text, spans = render_with_spans(MistralV3Template(), row["messages"], None, row_tools(row))
    assert '"call_id": "abc123XYZ"' in text
    assert [text[i:j] for i, j in spans] == [
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abc123XYZ"}]</s>',
        " It is 21C in Paris.</s>"]


def _tokenizer(tmp_path):
    """A small BPE tokenizer whose special tokens include every template's markers above."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    markers = sorted({t for _, options, _ in CLASSES.values() for t in options.get("special_tokens", [])} |
                     {"<|im_end|>", "<|endoftext|>"})
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["Hello there, how are you? It is 21C in Paris. First. Second."], trainers.BpeTrainer(
        vocab_size=400, special_tokens=markers, show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


# -- Command R7B, as it ships -----------------------------------------------------------------------

SHARED = Path(__file__).resolve().parents[2] / "shared" / "fixtures"
R7B = official_template("CohereForAI-c4ai-command-r7b-12-2024-tool_use")
needs_r7b = pytest.mark.skipif(
    R7B is None or not (SHARED / "tokenizers").is_dir(),
    reason=f"Command R7B's official chat template (llama.cpp's models/templates/, kept by `{FETCH}`; run it "
           "again where it was run before the templates were kept) or ../shared/fixtures is absent")
R7B_TOKENS = ["<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|SYSTEM_TOKEN|>", "<|USER_TOKEN|>",
              "<|CHATBOT_TOKEN|>", "<|START_THINKING|>", "<|END_THINKING|>", "<|START_ACTION|>", "<|END_ACTION|>",
              "<|START_RESPONSE|>", "<|END_RESPONSE|>", "<|START_TOOL_RESULT|>", "<|END_TOOL_RESULT|>"]
THINKING = {"off": {}, "on": {"enable_thinking": True}}  # off: the template's default
CALL_ROME = {"id": "def456UVW", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}
R7B_CONVERSATIONS = {
    "single": (SINGLE, None),
    "system": ([{"role": "system", "content": "Be brief."}, u("Hi there"), a("Hello.")], None),
    "multi": (MULTI, None),
    "weather": (WEATHER, TOOLS),
    "weather, no schemas": (WEATHER, None),
    "parallel calls": ([u("Paris and Rome?"), a("", tool_calls=[CALL, CALL_ROME]), tool("21C"),
                        {**tool("25C"), "tool_call_id": "def456UVW"}, a("21C and 25C.")], TOOLS),
    "two rounds": ([*WEATHER, u("And Rome?"), a("", tool_calls=[CALL_ROME]),
                    {**tool("25C"), "tool_call_id": "def456UVW"}, a("25C.")], TOOLS),
    "reasoning inline": ([u("One?"), a("<think>\nthink one\n</think>\n\nFirst.")], None),
    "ends with user": ([*MULTI[:2], u("Two?")], None),
}
ANSWER = "<|START_RESPONSE|>Hello!<|END_RESPONSE|><|END_OF_TURN_TOKEN|>"
CALL_PART = ('<|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": "get_weather", '
             '"parameters": {"city": "Paris"}}\n]<|END_ACTION|><|END_OF_TURN_TOKEN|>')


def r7b_parts(text: str, thinking: bool) -> list[str]:
    """Command R7B's assistant parts by its format, written from its template: what follows each chatbot
    header (with thinking off, the empty thinking block the generation prompt ends with too, as a past tool
    call renders it), through <|END_OF_TURN_TOKEN|>. The header every rendering ends with opens nothing."""
    empty_thinking = "" if thinking else "(?:" + re.escape("<|START_THINKING|><|END_THINKING|>") + ")?"
    opening = re.compile(re.escape("<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>") + empty_thinking)
    parts, pos = [], 0
    while (found := opening.search(text, pos)) is not None and found.end() < len(text):
        end = text.index("<|END_OF_TURN_TOKEN|>", found.end()) + len("<|END_OF_TURN_TOKEN|>")
        parts.append(text[found.end():end])
        pos = end
    return parts


@pytest.fixture(scope="module")
def llama3():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(SHARED / "tokenizers" / "llama3")


def r7b(kind: str, thinking: str, tokenizer):
    """(template, tokenizer) as a plan makes them: [template] use = "jinja" with the file, or "native" with
    the file as the tokenizer's own chat template; chat_template_kwargs for thinking on."""
    from test_template_conformance import template_for

    return template_for(kind, R7B, tokenizer, chat_template_kwargs=THINKING[thinking])


@needs_r7b
@pytest.mark.parametrize("thinking", list(THINKING))
@pytest.mark.parametrize("kind", ["jinja", "native"])
def test_command_r7b_trains_exactly_its_assistant_parts(kind, thinking, llama3):
    """Before: with thinking off every row was refused ("its header, the template's generation prompt '', is not
    in the rendered conversation"): the rendering ends with <|CHATBOT_TOKEN|><|START_THINKING|><|END_THINKING|>,
    asked for or not, and a past answer opens with <|CHATBOT_TOKEN|><|START_RESPONSE|>."""
    from transformers.utils.chat_template_utils import render_jinja_template

    template, tokenizer = r7b(kind, thinking, llama3)
    source = R7B.read_text(encoding="utf-8")
    for name, (messages, tools) in R7B_CONVERSATIONS.items():
        text, parts = trained(template, messages, tools, tokenizer)
        official = render_jinja_template([messages], tools=tools, chat_template=source,
                                         **tokenizer.special_tokens_map, **THINKING[thinking])[0][0]
        assert text == official, name
        assert text.endswith("<|CHATBOT_TOKEN|>" if thinking == "on" else
                             "<|CHATBOT_TOKEN|><|START_THINKING|><|END_THINKING|>"), name  # never trained
        assert parts == r7b_parts(text, thinking == "on"), (name, parts)
        assert len(parts) == sum(m["role"] == "assistant" for m in messages), name
    # Literally: an answer, and a tool call, which with thinking on opens with its (empty) thinking block.
    assert trained(template, SINGLE, None, tokenizer)[1] == [ANSWER]
    call = CALL_PART if thinking == "off" else "<|START_THINKING|><|END_THINKING|>" + CALL_PART
    assert trained(template, WEATHER, TOOLS, tokenizer)[1] == [
        call, "<|START_RESPONSE|>It is 21C in Paris.<|END_RESPONSE|><|END_OF_TURN_TOKEN|>"]


@needs_r7b
@pytest.mark.parametrize("thinking", list(THINKING))
def test_command_r7b_labels_are_the_assistant_tokens(thinking):
    """Through encode, on the tokenizer with Command R7B's markers as its special tokens (as the real one has
    them): each run of labelled tokens is one assistant part, to the token."""
    import datasets
    import transformers

    from ftcore_plugins.common.chat import encode, render_with_spans

    tokenizer = transformers.AutoTokenizer.from_pretrained(SHARED / "tokenizers" / "llama3")
    tokenizer.add_special_tokens({"additional_special_tokens": R7B_TOKENS})
    template, _ = r7b("jinja", thinking, tokenizer)
    rows = [{"messages": m, "tools": json.dumps(t) if t else None} for m, t in R7B_CONVERSATIONS.values()]
    cols, stats = encode(datasets.Dataset.from_list(rows), tokenizer, template, max_length=None)
    assert stats.kept == len(rows)
    for (messages, tools), ids, labels in zip(R7B_CONVERSATIONS.values(), cols["input_ids"], cols["labels"]):
        runs, run = [], []
        for token, label in zip(ids, labels):
            if label != -100:
                assert label == token
                run.append(token)
            elif run:
                runs.append(run)
                run = []
        runs += [run] if run else []
        text, spans = render_with_spans(template, messages, tokenizer, tools)
        assert [tokenizer.decode(r) for r in runs] == [text[i:j] for i, j in spans] == r7b_parts(text, thinking == "on")


@needs_r7b
@pytest.mark.parametrize("kind", ["jinja", "native"])
def test_command_r7b_refuses_in_one_line_what_it_cannot_train_and_names_what_works(kind, llama3):
    """A tool call's reasoning (the one reasoning Command R7B renders) needs thinking on: with thinking off the
    generation prompt closes the reasoning empty. An answer's reasoning it never renders."""
    import datasets

    from ftcore_plugins.common.chat import encode

    reasoned = [u("Weather in Paris?"), a("", tool_calls=[CALL], reasoning_content="I will look it up."),
                tool("21C"), a("It is 21C in Paris.")]
    rows = datasets.Dataset.from_list([{"messages": reasoned, "tools": json.dumps(TOOLS)}])
    template, tokenizer = r7b(kind, "off", llama3)
    with pytest.raises(FtcoreError) as refused:
        encode(rows, tokenizer, template, max_length=None, where="data.chat (tools.jsonl)")
    message = str(refused.value)
    assert "\n" not in message and message.startswith("data.chat (tools.jsonl), row 1: "), message
    assert ("assistant turn 1 (message 1) has reasoning_content, but with thinking off the template's generation "
            "prompt ends '<|END_THINKING|>', closing the reasoning before the model writes any; turn thinking on "
            "with [template] chat_template_kwargs = { enable_thinking = true }") in message, message
    template, tokenizer = r7b(kind, "on", llama3)
    assert trained(template, reasoned, TOOLS, tokenizer)[1] == [
        "<|START_THINKING|>I will look it up.<|END_THINKING|>" + CALL_PART,
        "<|START_RESPONSE|>It is 21C in Paris.<|END_RESPONSE|><|END_OF_TURN_TOKEN|>"]
    for thinking in THINKING:
        template, tokenizer = r7b(kind, thinking, llama3)
        with pytest.raises(FtcoreError, match=r"has reasoning_content, but the template does not render it.*"
                                              r"dropped_reasoning = \"warn\""):
            trained(template, [u("Hi"), a("Hello.", reasoning_content="Greet back.")], None, tokenizer)


# -- they train -----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", [*CLASSES, "mistral-v3"])
def test_each_kind_trains(name, tmp_path):
    """A tiny model learns the rows of each kind: the loss falls, on the trained tokens only."""
    from ftcore.testing import TinyModel, chat_rows, stage_context, tiny_model
    from ftcore_plugins.templates.mistral_v3 import MistralV3Template
    from ftcore_plugins.trainers.base import SFT

    if name == "mistral-v3":
        template = MistralV3Template()
    else:
        text, options, _ = CLASSES[name]
        template = jinja(tmp_path, text, **options)
    rows = [{"messages": m["messages"]} for m in chat_rows(24)]
    rows += [{"messages": WEATHER, "tools": json.dumps(TOOLS)}] * 8
    base = tiny_model(tmp_path / "model")
    model, tokenizer = template.prepare(base.model, base.tokenizer)
    ctx = stage_context(TinyModel(model, tokenizer, template), tmp_path, rows)
    SFT(SFT.Options(max_steps=10, batch_size=8, max_length=256, learning_rate=3e-3, logging_steps=1)).train(ctx)
    losses = ctx.reporter.losses("sft")
    assert len(losses) == 10 and losses[10] < 0.8 * losses[1], losses


@pytest.mark.slow
@needs_r7b
@pytest.mark.parametrize("thinking", list(THINKING))
def test_command_r7b_trains(thinking, tmp_path):
    """Chats and tool calls under Command R7B's own template, thinking off and on: the loss falls. Its system
    preamble is long (2,700 characters, 6,600 with tools), so the tiny tokenizer learns its words too."""
    from ftcore.testing import TinyModel, chat_rows, stage_context, text_rows, tiny_model
    from ftcore_plugins.templates.jinja import JinjaFileTemplate
    from ftcore_plugins.trainers.base import SFT

    template = JinjaFileTemplate(JinjaFileTemplate.Options(path=str(R7B), special_tokens=R7B_TOKENS,
                                                           chat_template_kwargs=THINKING[thinking]))
    chats = [{"messages": m["messages"]} for m in chat_rows(24)]
    words = [{"text": template.render(WEATHER, None, tools=TOOLS)}, *text_rows(64),
             *({"text": " ".join(m["content"] for m in row["messages"])} for row in chats)]
    base = tiny_model(tmp_path / "model", rows=words, vocab_size=1024, max_position_embeddings=2048)
    model, tokenizer = template.prepare(base.model, base.tokenizer)
    ctx = stage_context(TinyModel(model, tokenizer, template), tmp_path,
                        chats + [{"messages": WEATHER, "tools": json.dumps(TOOLS)}] * 8)
    SFT(SFT.Options(max_steps=10, batch_size=8, max_length=2048, learning_rate=3e-3, logging_steps=1)).train(ctx)
    losses = ctx.reporter.losses("sft")
    assert len(losses) == 10 and losses[10] < 0.8 * losses[1], losses


@pytest.mark.slow
def test_mistral_v3_trains_rows_with_tool_results_from_a_file(ftcore_plan, ftcore_run):
    """The whole path, as a user runs it: a JSONL file of OpenAI rows with tool calls and results (their ids), the
    data layer, ``[template] use = "mistral-v3"``, a tiny model: the run trains, every row kept."""
    from ftcore.testing import chat_rows, write_jsonl

    rows = [{"messages": WEATHER, "tools": TOOLS}] * 16 + chat_rows(16)
    write_jsonl(ftcore_plan.dir / "tools.jsonl", rows)
    plan = ftcore_plan({"template": {"use": "mistral-v3"}, "data": {"chat": {"path": "tools.jsonl"}},
                        "model": {"max_position_embeddings": 512},
                        "stage": [{"name": "sft", "trainer": "sft", "data": "chat", "adapter": "full", "max_steps": 6,
                                   "batch_size": 8, "max_length": 256, "learning_rate": 3e-3, "logging_steps": 1,
                                   "save_steps": 100}]})
    run = ftcore_run("run", plan, cwd=ftcore_plan.dir).check()
    losses = run.losses("sft")
    assert len(losses) == 6 and losses[6] < losses[1], losses
    report = json.loads((run.run_dir / "data_report.json").read_text())
    assert report["sft/train"]["kept"] == 32 and report["sft/train"]["skipped_unrenderable"] == 0
