"""Row formats -> the internal schema (docs/data.md), one conversion at a time, no files."""

from __future__ import annotations

import json

import pytest

from ftcore_plugins.common import formats as F
from ftcore_plugins.common.formats import RowError, convert, detect


def chat(row, fmt="auto", **kw):
    got_fmt, kind, out = convert(row, fmt, **kw)
    assert kind == "chat", (got_fmt, kind)
    return out["messages"], out["tools"]


def u(text):
    return {"role": "user", "content": text}


def a(text):
    return {"role": "assistant", "content": text}


def s(text):
    return {"role": "system", "content": text}


# -- alpaca ---------------------------------------------------------------------------------------

def test_alpaca_input_is_context_after_the_instruction_with_a_blank_line():
    messages, tools = chat({"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour"})
    assert messages == [u("Translate to French.\n\nGood morning"), a("Bonjour")]
    assert tools is None


def test_alpaca_empty_or_absent_input_leaves_the_instruction_alone():
    for row in ({"instruction": "Say hi.", "input": "", "output": "hi"}, {"instruction": "Say hi.", "output": "hi"},
                {"instruction": "Say hi.", "input": None, "output": "hi"}):
        assert chat(row)[0] == [u("Say hi."), a("hi")]


def test_alpaca_system_and_history_come_first_in_order():
    row = {"instruction": "And 3+3?", "output": "6", "system": "Be brief.",
           "history": [["1+1?", "2"], ["2+2?", "4"]]}
    assert chat(row)[0] == [s("Be brief."), u("1+1?"), a("2"), u("2+2?"), a("4"), u("And 3+3?"), a("6")]


def test_alpaca_bad_history_names_the_pair():
    with pytest.raises(RowError, match=r"'history\[1\]' must be a \[user, assistant\] pair") as info:
        convert({"instruction": "x", "output": "y", "history": [["a", "b"], ["only one"]]})
    assert info.value.reason == "wrong_type" and info.value.field == "history"


def test_alpaca_missing_output_names_it_lists_fields_and_suggests_the_mapping():
    with pytest.raises(RowError) as info:
        convert({"instruction": "x", "answer": "y"})
    msg = str(info.value)
    assert "missing field 'output'" in msg and "(fields: instruction, answer)" in msg
    assert 'columns = { output = "answer" }' in msg and "format" in msg  # format was guessed: say how to set it
    with pytest.raises(RowError, match=r'map it with columns = \{ output = "..." \}'):
        convert({"instruction": "x", "zzz": "y"})  # no field looks like an answer
    assert info.value.field == "output" and info.value.reason == "missing_field"


def test_column_mapping_applies_before_detection():
    row = {"question": "2+2?", "context": "arithmetic", "answer": "4"}
    with pytest.raises(RowError, match="cannot tell the row's format .*question, context, answer"):
        convert(row)
    fmt, kind, out = convert(row, columns={"instruction": "question", "input": "context", "output": "answer"})
    assert (fmt, kind) == ("alpaca", "chat")
    assert out["messages"] == [u("2+2?\n\narithmetic"), a("4")]


def test_mapped_field_that_is_empty_says_where_it_came_from():
    with pytest.raises(RowError, match="mapped from the file's 'answer'"):
        convert({"question": "q", "answer": None}, columns={"instruction": "question", "output": "answer"})


def test_mapping_wins_over_a_field_of_the_same_name():
    row = {"instruction": "old", "prompt_text": "new", "output": "o"}
    assert chat(row, columns={"instruction": "prompt_text"})[0][0] == u("new")


# -- sharegpt -----------------------------------------------------------------------------------------

def test_sharegpt_roles_system_field_and_tools():
    tools = [{"name": "f", "description": "d", "parameters": {"type": "object", "properties": {}}}]
    row = {"system": "sys", "tools": json.dumps(tools),
           "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"},
                             {"from": "user", "value": "q2"}, {"from": "assistant", "value": "a2"}]}
    messages, got_tools = chat(row)
    assert messages == [s("sys"), u("q"), a("a"), u("q2"), a("a2")]
    assert json.loads(got_tools) == tools


def test_sharegpt_function_call_becomes_tool_calls_and_observation_a_named_tool_turn():
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    row = {"conversations": [{"from": "human", "value": "Weather in Paris?"},
                             {"from": "function_call", "value": json.dumps(call)},
                             {"from": "observation", "value": '{"temp": 21}'},
                             {"from": "gpt", "value": "21 degrees."}],
           "tools": [{"name": "get_weather"}]}
    messages, tools = chat(row)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert messages[1]["content"] == ""
    assert json.loads(messages[1]["tool_calls"]) == [{"type": "function", "function": call}]
    assert messages[2] == {"role": "tool", "content": '{"temp": 21}', "name": "get_weather"}
    assert "tool_calls" not in messages[3] and "name" not in messages[0]
    assert json.loads(tools) == [{"name": "get_weather"}]  # a list is stored as a JSON string


def test_sharegpt_function_call_after_assistant_text_joins_that_turn_and_tool_role_alias():
    row = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "Let me check."},
                             {"from": "function_call", "value": '[{"name": "a", "arguments": {}}, '
                                                                '{"name": "b", "arguments": {}}]'},
                             {"from": "tool", "value": "ra"}, {"from": "observation", "value": "rb"}]}
    messages, _ = chat(row)
    assert len(messages) == 4
    assert messages[1]["content"] == "Let me check." and len(json.loads(messages[1]["tool_calls"])) == 2
    assert [m.get("name") for m in messages[2:]] == ["a", "b"]


def test_sharegpt_empty_tools_are_none_and_bad_function_call_is_an_error():
    turns = [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]
    assert chat({"conversations": turns, "tools": ""})[1] is None
    assert chat({"conversations": turns, "tools": "[]"})[1] is None
    with pytest.raises(RowError, match=r"'conversations\[1\]\.value' of a function_call turn must be JSON"):
        convert({"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "get()"}]})


def test_sharegpt_unknown_role_and_empty_conversation():
    with pytest.raises(RowError, match=r"unknown role 'bot' in 'conversations\[0\]\.from'") as info:
        convert({"conversations": [{"from": "bot", "value": "x"}]})
    assert info.value.reason == "unknown_role"
    with pytest.raises(RowError, match="empty conversation") as info:
        convert({"conversations": []})
    assert info.value.reason == "empty_conversation"


# -- openai messages ------------------------------------------------------------------------------

def test_messages_keep_tool_calls_tool_names_and_call_ids_and_drop_other_keys():
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    row = {"messages": [u("q"), {"role": "assistant", "content": None, "tool_calls": calls, "weight": 1, "x": 1},
                        {"role": "tool", "content": "r", "tool_call_id": "c1", "extra": "dropped"}, a("done")]}
    messages, _ = chat(row)
    assert messages[1] == {"role": "assistant", "content": "", "tool_calls": json.dumps(calls)}  # weight 1: trained
    # named after the call it answers; its call id kept (Mistral's and Kimi's templates render it)
    assert messages[2] == {"role": "tool", "content": "r", "name": "f", "tool_call_id": "c1"}
    assert messages[3] == a("done")
    with pytest.raises(RowError, match=r"'messages\[2\]\.tool_call_id' must be a string, got a list"):
        convert({"messages": [u("q"), row["messages"][1], {"role": "tool", "content": "r", "tool_call_id": [1]}]})


def test_every_message_key_a_template_reads_is_a_column_of_the_batch():
    """Keys the data layer keeps reach Arrow (``features``) and the batch, so templates can read them."""
    keys = set(F.features("chat")["messages"].feature)
    assert {"role", "content", "tool_calls", "name", "reasoning_content", "tool_call_id"} <= keys
    row = {"messages": [u("q"), {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
           "function": {"name": "f", "arguments": {}}}]}, {"role": "tool", "content": "r", "tool_call_id": "c1"}]}
    out = F.convert_batch({"messages": [row["messages"]]}, "auto", "chat")
    assert out["messages"][0][2]["tool_call_id"] == "c1"


def test_messages_content_parts_are_joined_and_wrong_types_named():
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]
    assert chat({"messages": [{"role": "user", "content": parts}, a("hi")]})[0] == [u("Hello there"), a("hi")]
    with pytest.raises(RowError, match="field 'messages' must be a list of messages, got a string"):
        convert({"messages": "hello"})
    with pytest.raises(RowError, match=r"'messages\[0\]\.content' must be a string"):
        convert({"messages": [{"role": "user", "content": 3}]})
    with pytest.raises(RowError, match=r"unknown role 'bot' in 'messages\[0\]\.role'"):
        convert({"messages": [{"role": "bot", "content": "x"}]})
    with pytest.raises(RowError, match=r"only assistant turns call tools"):
        convert({"messages": [{"role": "user", "content": "x", "tool_calls": "[{}]"}]})


def test_openai_is_an_alias_of_messages():
    assert convert({"messages": [u("q"), a("a")]}, "openai")[0] == "messages"


# -- prompt / completion ------------------------------------------------------------------------------

def test_prompt_completion_strings_are_a_completion_row_lists_a_chat_row():
    assert convert({"prompt": "The sky is", "completion": " blue."}) == \
        ("prompt_completion", "completion", {"prompt": "The sky is", "completion": " blue."})
    fmt, kind, out = convert({"prompt": [u("q")], "completion": [a("a")]})
    assert (fmt, kind, out["messages"]) == ("prompt_completion", "chat", [u("q"), a("a")])
    with pytest.raises(RowError, match="both as strings .* or both as message lists"):
        convert({"prompt": "q", "completion": [a("a")]})


# -- preference ---------------------------------------------------------------------------------------

def test_explicit_preference_with_strings():
    assert convert({"prompt": "2+2?", "chosen": "4", "rejected": "5"}) == (
        "preference", "preference", {"prompt": [u("2+2?")], "chosen": [a("4")], "rejected": [a("5")]})


def test_explicit_preference_with_message_lists_and_a_system_field():
    row = {"system": "sys", "prompt": [u("hi"), a("hello"), u("2+2?")],
           "chosen": [a("4")], "rejected": [{"from": "gpt", "value": "5"}]}
    fmt, kind, out = convert(row)
    assert out == {"prompt": [s("sys"), u("hi"), a("hello"), u("2+2?")], "chosen": [a("4")], "rejected": [a("5")]}


def test_sharegpt_preference_answers_are_single_turns():
    row = {"conversations": [{"from": "system", "value": "sys"}, {"from": "human", "value": "q"}],
           "chosen": {"from": "gpt", "value": "good"}, "rejected": {"from": "gpt", "value": "bad"}}
    assert convert(row) == ("sharegpt_preference", "preference",
                            {"prompt": [s("sys"), u("q")], "chosen": [a("good")], "rejected": [a("bad")]})


def test_identical_chosen_and_rejected_is_its_own_reason():
    with pytest.raises(RowError, match="identical") as info:
        convert({"prompt": "q", "chosen": "same", "rejected": "same"})
    assert info.value.reason == "identical_chosen_rejected"
    assert info.value.reason in F.ALWAYS_SKIP


def test_implicit_preference_splits_the_longest_common_prefix():
    shared = [s("sys"), u("q1"), a("a1"), u("q2")]
    row = {"chosen": [*shared, a("good")], "rejected": [*shared, a("bad")]}
    assert convert(row) == ("implicit_preference", "preference",
                            {"prompt": shared, "chosen": [a("good")], "rejected": [a("bad")]})


def test_implicit_preference_answer_may_include_tool_turns_but_no_user_turn():
    shared = [u("q")]
    calling = {**a("calling"), "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}]}
    row = {"chosen": [*shared, calling, {"role": "tool", "content": "r"}, a("done")],
           "rejected": [*shared, a("no")]}
    out = convert(row)[2]
    assert out["prompt"] == shared and len(out["chosen"]) == 3


def test_implicit_preference_errors():
    with pytest.raises(RowError, match="share no leading messages") as info:
        convert({"chosen": [u("q"), a("x")], "rejected": [u("other q"), a("y")]})
    assert info.value.reason == "no_shared_prefix"
    with pytest.raises(RowError, match=r"differ at message 1 \(assistant turn\), before the last assistant turn"):
        convert({"chosen": [u("q"), a("x"), u("more"), a("z")], "rejected": [u("q"), a("y"), u("more"), a("z2")]})
    with pytest.raises(RowError, match="is a prefix of it"):
        convert({"chosen": [u("q"), a("x")], "rejected": [u("q"), a("x"), u("more"), a("z")]})
    with pytest.raises(RowError, match="must be a whole conversation .* when there is no 'prompt'"):
        convert({"chosen": "x", "rejected": "y"})


# -- KTO ----------------------------------------------------------------------------------------------

def test_kto_messages_split_the_last_assistant_turn_off_as_the_completion():
    row = {"messages": [u("q"), a("a1"), u("q2"), a("a2")], "label": False}
    assert convert(row) == ("kto", "unpaired_preference",
                            {"prompt": [u("q"), a("a1"), u("q2")], "completion": [a("a2")], "label": False})


def test_kto_prompt_completion_strings_and_csv_labels():
    row = {"prompt": "q", "completion": "a", "label": True}
    assert convert(row)[2] == {"prompt": [u("q")], "completion": [a("a")], "label": True}
    assert convert({**row, "label": "false"}, strings=True)[2]["label"] is False  # CSV: values are strings
    with pytest.raises(RowError, match="'label' must be a boolean .* got a string 'false'") as info:
        convert({**row, "label": "false"})  # JSON: a string is not a boolean
    assert info.value.reason == "label_not_bool"
    with pytest.raises(RowError, match="got a number 1"):
        convert({**row, "label": 1})


def test_kto_last_message_must_be_the_answer():
    with pytest.raises(RowError, match="last message of 'messages' must be the assistant's answer"):
        convert({"messages": [u("q"), a("a"), u("q2")], "label": True})


# -- text and detection -------------------------------------------------------------------------------

def test_text_rows_and_empty_text():
    assert convert({"text": "Once upon a time."}) == ("text", "text", {"text": "Once upon a time."})
    with pytest.raises(RowError) as info:
        convert({"text": "  \n"})
    assert info.value.reason == "empty_text" and info.value.reason in F.ALWAYS_SKIP


@pytest.mark.parametrize("row, fmt", [
    ({"messages": [u("q")], "label": True}, "kto"),
    ({"prompt": "q", "completion": "a", "label": True}, "kto"),
    ({"conversations": [], "chosen": {}, "rejected": {}}, "sharegpt_preference"),
    ({"prompt": "q", "chosen": "a", "rejected": "b"}, "preference"),
    ({"chosen": [], "rejected": []}, "implicit_preference"),
    ({"conversations": [], "tools": "[]"}, "sharegpt"),
    ({"messages": [], "text": "t"}, "messages"),
    ({"instruction": "i", "output": "o", "text": "t"}, "alpaca"),
    ({"instruction": "i", "output": "o", "label": "spam"}, "alpaca"),  # a label alone does not make KTO
    ({"prompt": "p", "completion": "c"}, "prompt_completion"),
    ({"text": "t", "meta": 1}, "text"),
    ({"text": "t", "messages": None}, "text"),  # null fields (Arrow fills them in) do not count ...
    ({"instruction": None, "output": "o"}, "alpaca"),  # ... unless nothing else matches (an empty CSV cell)
])
def test_detection_precedence(row, fmt):
    assert detect(row) == fmt


def test_explicit_format_overrides_detection():
    row = {"instruction": "i", "output": "o", "text": "raw"}
    assert convert(row, "text")[2] == {"text": "raw"}
    with pytest.raises(RowError, match="missing field 'messages'"):
        convert(row, "messages")


def test_not_an_object():
    with pytest.raises(RowError, match="expected an object with fields, got a list"):
        convert([1, 2])


# -- batches ------------------------------------------------------------------------------------------

def test_convert_batch_never_raises_and_marks_bad_rows_in_order():
    batch = {"instruction": ["a", None, "c", "d"], "output": ["1", None, None, "4"], "text": [None, "t", None, None]}
    out = F.convert_batch(batch, "auto", "chat")
    assert list(out) == ["messages", "tools", "images", F.ERROR_COLUMN, F.FORMAT_COLUMN]  # both pruned when unused
    assert out[F.FORMAT_COLUMN] == ["alpaca", None, None, "alpaca"]
    empty = {"tool_calls": None, "name": None, "reasoning_content": None, "tool_call_id": None, "weight": None}
    assert out["messages"][0] == [{"role": "user", "content": "a", **empty},
                                  {"role": "assistant", "content": "1", **empty}]
    assert out["messages"][1] is None and out[F.ERROR_COLUMN][0] is None
    # row 1 is a text row among chat rows, row 2 lacks `output`
    errors = [RowError.decode(e) if e else None for e in out[F.ERROR_COLUMN]]
    assert errors[1].reason == "mixed_kind" and errors[2].reason == "missing_field" and errors[3] is None


def test_conversion_is_deterministic():
    rows = [{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
            for i in range(50)]
    assert F.convert_rows(rows, "auto", "chat") == F.convert_rows(rows, "auto", "chat")


# -- conversation rules (docs/data.md, "Conversation rules") ------------------------------------------

def error_of(row, **kw):
    with pytest.raises(RowError) as info:
        convert(row, **kw)
    return str(info.value), info.value.reason, info.value.field


def test_an_empty_assistant_turn_is_an_error():
    assert error_of({"messages": [u("q"), a("  ")]}) == (
        "'messages[1]' is an assistant turn with empty content (and no tool_calls): it would train on the "
        "end-of-turn token alone", "empty_answer", "messages")
    assert error_of({"instruction": "q", "output": ""})[0].startswith(
        "the 'output' field is an assistant turn with empty content")
    # A turn that calls a tool (or reasons) has something to train on.
    calls = [{"type": "function", "function": {"name": "f", "arguments": {}}}]
    convert({"messages": [u("q"), {"role": "assistant", "content": "", "tool_calls": calls},
                          {"role": "tool", "content": "r"}, a("done")]})


@pytest.mark.parametrize("roles, message", [
    (("assistant", "assistant", "user"),
     "'messages[1]' is a second assistant turn in a row; merge them into one message"),
    (("user", "user", "assistant"), "'messages[1]' is a second user turn in a row; merge them into one message"),
    (("user", "system", "assistant"),
     "'messages[1]' is a system turn after a user turn; the system message may only come first (once)"),
    (("user", "tool", "assistant"),
     "'messages[1]' is a tool result after a user turn without tool_calls; tool results follow the assistant "
     "turn that calls the tool"),
])
def test_roles_out_of_order_name_the_message(roles, message):
    row = {"messages": [{"role": r, "content": "x"} for r in roles]}
    assert error_of(row)[:2] == (message, "role_order")


def test_a_chat_row_without_an_answer_is_a_prompt():
    assert convert({"messages": [s("S"), u("q")]})[1:] == ("chat", {"messages": [s("S"), u("q")], "tools": None})


def test_the_system_field_counts_as_the_first_message():
    assert error_of({"system": "S", "messages": [s("again"), u("q"), a("x")]})[0] == \
        "'messages[0]' is a system turn after a system turn; the system message may only come first (once)"
    assert error_of({"system": "S", "conversations": [{"from": "gpt", "value": "x"}, {"from": "gpt", "value": "y"}]}
                    )[0] == "'conversations[1]' is a second assistant turn in a row; merge them into one message"


def test_prompts_need_no_answer_but_keep_the_order():
    out = convert({"prompt": [s("S"), u("q")], "chosen": "yes", "rejected": "no"})[2]
    assert out["prompt"] == [s("S"), u("q")]
    assert error_of({"prompt": [u("q"), u("again")], "chosen": "yes", "rejected": "no"})[0] == \
        "'prompt[1]' is a second user turn in a row; merge them into one message"
    assert error_of({"prompt": [u("q")], "chosen": "yes", "rejected": " "})[0].startswith(
        "the 'rejected' field is an assistant turn with empty content")


def test_content_parts_mixing_value_and_text_say_so():
    # All parts with `value` are LLaMA-Factory v1's (test_llamafactory_v1_rows); OpenAI parts with one `value`
    # among them are a mixed-up file.
    row = {"messages": [u("q"), {"role": "assistant", "content": [{"type": "text", "text": "hi "},
                                                                  {"type": "text", "value": "there"}]}]}
    assert error_of(row) == ("'messages[1].content[1]' has 'value'; text parts need 'text'", "missing_field",
                             "messages")
    row["messages"][1]["content"] = [{"type": "input_audio", "input_audio": {"data": "x"}}]
    assert error_of(row)[0] == "'messages[1].content[0]' is a 'input_audio' part; only text parts " \
        "{\"type\": \"text\", \"text\": ...} and image parts are supported"


def test_placeholders_are_found_in_any_message_text():
    row = {"messages": [u("Write to {{ name }} about {{topic}}"), a("ok")]}
    assert convert(row)[2]["messages"][0]["content"].startswith("Write to {{ name }}")  # allowed by default
    assert error_of(row, placeholders="error") == (
        "'messages[0].content' holds the template placeholder '{{ name }}', never filled in (set placeholders = "
        "\"allow\" in the source to train it as it is)", "placeholder", "messages")
    assert F.convert_found(row, placeholders="warn")[3] == "'messages[0].content' holds '{{ name }}'"
    alpaca = {"instruction": "Greet {{user.name}}", "output": "Hi"}
    assert error_of(alpaca, placeholders="error")[0].startswith("'instruction' holds the template placeholder")
    for text in ("a {{ x + 1 }} b", "{{}}", "{ {name} }", "f'{{'"):  # not an unfilled slot
        assert F.convert_found({"messages": [u(text), a("ok")]}, placeholders="warn")[3] is None
    assert F.convert_found({"text": "{{name}}"}, placeholders="error")[1] == "text"  # text rows: not messages


# -- reasoning ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("key", F.REASONING_KEYS)
def test_reasoning_under_any_name_becomes_reasoning_content(key):
    row = {"messages": [u("2+2?"), {"role": "assistant", "content": "4", key: "2 and 2 make 4"}]}
    assert chat(row)[0][1] == {"role": "assistant", "content": "4", "reasoning_content": "2 and 2 make 4"}
    sharegpt = {"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4", key: "sum"}]}
    assert chat(sharegpt)[0][1]["reasoning_content"] == "sum"


def test_reasoning_conflicts_and_wrong_roles_are_errors():
    same = {"role": "assistant", "content": "4", "thinking": "r", "reasoning_content": "r"}
    assert chat({"messages": [u("q"), same]})[0][1]["reasoning_content"] == "r"
    differ = {**same, "thinking": "other"}
    assert error_of({"messages": [u("q"), differ]}) == (
        "'messages[1]' has both 'reasoning_content' and 'thinking', and they differ; give the reasoning once",
        "conflicting_fields", "messages")
    assert error_of({"messages": [{**u("q"), "reasoning": "why"}, a("x")]})[0] == \
        "'messages[0]' is a user turn with 'reasoning'; only assistant turns carry reasoning"
    assert error_of({"messages": [u("q"), {**a("x"), "thinking": 3}]})[0] == \
        "field 'messages[1].thinking' must be a string, got a number"
    # <think> in content stays there: the template decides what to do with it.
    assert chat({"messages": [u("q"), a("<think>hm</think>4")]})[0][1] == a("<think>hm</think>4")


def test_reasoning_is_a_column_of_the_batch_and_of_the_features():
    rows = [{"messages": [u("q"), {"role": "assistant", "content": "4", "thinking": "r"}]}]
    out = F.convert_rows(rows, "auto", "chat")
    assert out["messages"][0][1]["reasoning_content"] == "r" and out["messages"][0][0]["reasoning_content"] is None
    assert "reasoning_content" in F.features("chat")["messages"].feature


# -- LLaMA-Factory v1 ---------------------------------------------------------------------------------

def lf(role, *parts, weight=None):
    """A LLaMA-Factory v1 message: typed parts ``(type, value)`` and its ``loss_weight``."""
    weight = (1.0 if role == "assistant" else 0.0) if weight is None else weight
    return {"role": role, "content": [{"type": t, "value": v} for t, v in parts], "loss_weight": weight}


LF_CALL = json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})
LF_ROW = {"messages": [
    lf("system", ("text", "Be brief.")),
    lf("user", ("text", "Hi"), ("text", " there")),
    lf("assistant", ("text", "Hello!"), weight=0.0),  # kept as context, not trained
    lf("user", ("text", "Weather in Paris?")),
    lf("assistant", ("reasoning", "A tool knows."), ("tool_call", LF_CALL)),
    lf("tool", ("text", "21C")),
    lf("assistant", ("text", "It is 21C."))],
    "tools": json.dumps([{"name": "get_weather", "description": "Weather", "parameters": {"type": "object"}}])}


def test_llamafactory_v1_rows():
    """LLaMA-Factory v1's rows (content as {"type", "value"} parts, a loss_weight per message) read as chat rows:
    text parts joined, reasoning and tool_call parts as reasoning_content and tool_calls, loss_weight 0 on an
    assistant turn kept as `weight = 0` (context, not trained); their preference rows' chosen_messages and
    rejected_messages are whole conversations."""
    messages, tools = chat(LF_ROW)
    call = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert messages == [{"role": "system", "content": "Be brief."}, u("Hi there"), {**a("Hello!"), "weight": 0},
                        u("Weather in Paris?"),
                        {"role": "assistant", "content": "", "tool_calls": json.dumps(call),
                         "reasoning_content": "A tool knows."},
                        {"role": "tool", "content": "21C", "name": "get_weather"}, a("It is 21C.")]
    assert json.loads(tools)[0]["name"] == "get_weather"
    # A "tools" part (a system message's, say) gives the row's schemas.
    parts = {"messages": [lf("system", ("tools", '[{"name": "f"}]'), ("text", "S")), lf("user", ("text", "q")),
                          lf("assistant", ("text", "a"))]}
    assert chat(parts) == ([{"role": "system", "content": "S"}, u("q"), a("a")], '[{"name": "f"}]')
    pair = {"chosen_messages": [lf("user", ("text", "q")), lf("assistant", ("text", "good"))],
            "rejected_messages": [lf("user", ("text", "q")), lf("assistant", ("text", "bad"))]}
    assert convert(pair) == ("implicit_preference", "preference",
                             {"prompt": [u("q")], "chosen": [a("good")], "rejected": [a("bad")]})


def test_llamafactory_v1_weights_and_parts_that_cannot_be_read_are_named():
    assert error_of({"messages": [lf("user", ("text", "q")), lf("assistant", ("text", "a"), weight=0.5)]})[0] == (
        "'messages[1].loss_weight' must be 0 (not trained) or 1 (trained), got 0.5: ftcore trains a turn or not")
    assert error_of({"messages": [lf("user", ("text", "q"), weight=1.0), lf("assistant", ("text", "a"))]})[0] == (
        "'messages[0]' is a user turn with loss_weight = 1, but only assistant turns are trained (set "
        "train_on_inputs = true in the stage to train the whole conversation)")
    assert error_of({"messages": [lf("user", ("image_url", "x.png")), lf("assistant", ("text", "a"))]})[0] == (
        "'messages[0].content[0]' is a 'image_url' part; ftcore reads text, reasoning, tool_call and tools parts")
    assert error_of({"messages": [lf("user", ("text", "q")), lf("assistant", ("tool_call", "{oops"))]})[0].startswith(
        "'messages[1].content[0].value' of a tool_call part must be JSON like")
    # OpenAI's `weight` is read the same way.
    assert chat({"messages": [u("q"), {**a("x"), "weight": 0}, u("r"), a("y")]})[0][1] == {**a("x"), "weight": 0}


def test_llamafactory_v1_turns_with_loss_weight_0_are_not_trained():
    from ftcore_plugins.common.chat import row_samples
    from ftcore_plugins.templates.chatml import ChatMLTemplate

    messages, _ = chat(LF_ROW)
    template = ChatMLTemplate()
    [(text, spans)] = row_samples({"messages": messages[:3] + [u("Again?"), a("Sure.")]}, None, template)
    assert [text[i:j] for i, j in spans] == ["Sure.<|im_end|>"]  # "Hello!" (loss_weight 0) is not trained
    [(text, spans)] = row_samples({"messages": messages[:3]}, None, template)
    assert spans == []  # nothing to train: the sample is dropped (dropped_no_labels)
    per_turn = ChatMLTemplate(ChatMLTemplate.Options(samples="per_turn"))
    samples = row_samples({"messages": messages[:3] + [u("Again?"), a("Sure.")]}, None, per_turn)
    assert [[t[i:j] for i, j in sp] for t, sp in samples] == [["Sure.<|im_end|>"]]
    assert "weight" not in row_samples({"messages": messages[:3] + [u("Again?"), a("Sure.")]}, None,
                                       template)[0][0]
