"""The span locator's refusals: rows whose assistant turns cannot be located are one line naming the data,
the row, the template and the fix, or a counted skip under on_error = "skip"."""

from __future__ import annotations

import pytest

from ftcore.errors import FtcoreError

# Branches on the content's last character: a marker there changes the rendering, so turns cannot be marked.
INSPECTING = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
              "{% if m.content[-1] == '!' %} (excited){% endif %}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def rows():
    return [{"messages": [{"role": "user", "content": f"q{k}"}, {"role": "assistant", "content": f"a{k}!"}],
             "tools": None} for k in range(3)]


@pytest.fixture
def inspecting(tmp_path):
    from ftcore_plugins.templates.jinja import JinjaFileTemplate

    path = tmp_path / "inspecting.jinja"
    path.write_text(INSPECTING, encoding="utf-8")
    return JinjaFileTemplate(JinjaFileTemplate.Options(path=str(path), stop_tokens=["<|im_end|>"]))


def test_an_unlocatable_turn_names_the_data_the_row_the_template_and_the_fix(inspecting, ftcore_tiny_model,
                                                                             tmp_path, monkeypatch):
    import datasets

    monkeypatch.chdir(tmp_path)  # the template file is named relative to the working folder

    from ftcore_plugins.common.chat import encode

    with pytest.raises(FtcoreError) as err:
        encode(datasets.Dataset.from_list(rows()), ftcore_tiny_model.tokenizer, inspecting, max_length=None,
               where="data.chat (chat.jsonl)")
    assert str(err.value) == (
        "data.chat (chat.jsonl), row 1: template 'jinja' (inspecting.jinja): the template renders a message differently when its text changes (it "
        "escapes or tests the content), so turns cannot be located by marking them; set [template] use = "
        "\"chatml\" (or another named template), train_on_inputs = true, or on_error = \"skip\" in the data "
        "source (`ftcore validate --data PLAN` lists every such row with its file and line)")


def test_under_skip_such_rows_are_counted_and_the_rest_train(inspecting, ftcore_tiny_model):
    import datasets

    from ftcore_plugins.common.chat import encode
    from ftcore_plugins.templates.chatml import ChatMLTemplate

    mixed = datasets.Dataset.from_list(rows())
    _, stats = encode(mixed, ftcore_tiny_model.tokenizer, inspecting, max_length=None, on_error="skip")
    assert (stats.rows, stats.skipped_unrenderable, stats.kept) == (3, 3, 0)
    _, stats = encode(mixed, ftcore_tiny_model.tokenizer, ChatMLTemplate(), max_length=None, on_error="skip")
    assert (stats.rows, stats.skipped_unrenderable, stats.kept) == (3, 0, 3)


def test_private_use_characters_in_a_row_are_refused_not_misread():
    from ftcore_plugins.common.spans import SpanError, SpanLocator
    from ftcore_plugins.templates.chatml import ChatMLTemplate

    locator = SpanLocator(ChatMLTemplate(), None)
    text, spans = locator.locate([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    assert [text[a:b] for a, b in spans] == ["yo<|im_end|>"]
    with pytest.raises(SpanError, match="private-use"):
        locator.locate([{"role": "user", "content": "hi \U000F0001"}, {"role": "assistant", "content": "yo"}])


def test_a_tool_call_the_template_cannot_show_is_refused():
    from ftcore_plugins.common.spans import SpanError, SpanLocator
    from ftcore_plugins.templates.chatml import ChatMLTemplate

    call = {"type": "function", "function": {"name": "lookup", "arguments": {}}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "one moment", "tool_calls": [call]}]
    with pytest.raises(SpanError, match="calls the tool 'lookup', but the template does not render tool calls"):
        SpanLocator(ChatMLTemplate(), None).locate(messages)
