"""The built-in families added for issue #13 (qwen3, llama3.1, mistral-v3, tekken, gemma3, phi4,
deepseek-r1, gpt-oss): each renders what its model's own chat template renders, conversation kind
by conversation kind, refuses what that template refuses, is listed, and prepares a tokenizer."""

from __future__ import annotations

import datetime
import functools
import importlib
import json

import pytest

from conftest import SHARED, run_cli

pytest.importorskip("transformers")

from ftcore.errors import FtcoreError  # noqa: E402

FAMILIES = {
    "qwen3": ("qwen3", "Qwen3Template"),
    "llama3.1": ("llama31", "Llama31Template"),
    "mistral-v3": ("mistral_v3", "MistralV3Template"),
    "tekken": ("tekken", "TekkenTemplate"),
    "gemma3": ("gemma3", "Gemma3Template"),
    "phi4": ("phi4", "Phi4Template"),
    "deepseek-r1": ("deepseek_r1", "DeepSeekR1Template"),
    "gpt-oss": ("gpt_oss", "GptOssTemplate"),
}

# The official template of each family: a fixture file (llama.cpp's copies, see
# ../shared/fixtures/README.md) or a real tokenizer's tokenizer_config.json. None: no fixture;
# those families are checked against their embedded text and hand-written renderings below.
OFFICIAL = {
    "qwen3": ["tokenizers/qwen3", "templates/Qwen-Qwen3-0.6B.jinja"],
    "llama3.1": ["templates/meta-llama-Llama-3.1-8B-Instruct.jinja",
                 "templates/meta-llama-Llama-3.3-70B-Instruct.jinja"],
    "tekken": ["templates/mistralai-Mistral-Nemo-Instruct-2407.jinja"],
    "deepseek-r1": ["templates/deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"],
    "gpt-oss": ["templates/openai-gpt-oss-120b.jinja"],
    "mistral-v3": [],
    "gemma3": [],
    "phi4": [],
}

# The models' own bos/eos, as their tokenizers would give them to the template.
SPECIALS = {
    "qwen3": {"eos_token": "<|im_end|>"},
    "llama3.1": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "mistral-v3": {"bos_token": "<s>", "eos_token": "</s>"},
    "tekken": {"bos_token": "<s>", "eos_token": "</s>"},
    "gemma3": {"bos_token": "<bos>", "eos_token": "<eos>"},
    "phi4": {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"},
    "deepseek-r1": {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"},
    "gpt-oss": {"bos_token": "<|startoftext|>", "eos_token": "<|return|>"},
}


def family(name, **options):
    module, cls_name = FAMILIES[name]
    cls = getattr(importlib.import_module(f"ftcore_plugins.templates.{module}"), cls_name)
    return cls(cls.Options(**options))


def shared(relative):
    path = SHARED / relative
    if not path.exists():
        pytest.skip(f"../shared/fixtures/{relative} not present")
    return path


@functools.lru_cache(maxsize=None)
def _tokenizer(name):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SHARED / "tokenizers" / name)


def real_tokenizer(name):
    """A shared, read-only instance: tests that change a tokenizer load their own."""
    shared(f"tokenizers/{name}")
    return _tokenizer(name)


def official_text(relative):
    path = shared(relative)
    if path.is_dir():
        return json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))["chat_template"]
    return path.read_text(encoding="utf-8")


def official_render(text, messages, gen, tools=None, **variables):
    """What transformers renders with a model's own template text."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[messages], chat_template=text, tools=tools,
                                        add_generation_prompt=gen, **variables)
    return rendered[0]


# -- conversations ---------------------------------------------------------------------------


def u(content):
    return {"role": "user", "content": content}


def a(content, **extra):
    return {"role": "assistant", "content": content, **extra}


def s(content):
    return {"role": "system", "content": content}


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city."}},
                   "required": ["city"]}}}]
CALL = {"id": "call12345", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
RESULT = {"role": "tool", "tool_call_id": "call12345", "name": "get_weather", "content": '{"temp": 21}'}
# As most chat data stores a call: no text beside it, arguments a JSON string.
CALL_TEXT = {**CALL, "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}

CONVERSATIONS = {
    "single-turn": ([u("Hi"), a("Hello!")], None),
    "system": ([s("You are terse."), u("Hi there"), a("Hello.")], None),
    "multi-turn": ([u("Hi there"), a("Hello."), u("Name a colour"), a("Blue, like the sea."), u("Another?"),
                    a("Green.")], None),
    "system-multi-turn": ([s("  You are terse.\n"), u("  Hi there "), a("\nHello.\n\n"),
                           u("日本語で「こんにちは」は？"), a("こんにちは — «hello» ☀️")], None),
    "tools": ([s("You help with weather."), u("Weather in Paris?"), a("", tool_calls=[CALL]), RESULT,
               a("It is 21 degrees in Paris.")], TOOLS),
    "tool-calls-without-schema": ([u("Weather in Paris?"), a(None, tool_calls=[CALL_TEXT]), RESULT,
                                   a("21 degrees.")], None),
    "reasoning": ([u("What is 2+2?"), a("4.", reasoning_content="Two plus two is four."), u("And 3+3?"),
                   a("6.", reasoning_content="Three plus three is six.")], None),
    "think-inline": ([u("What is 2+2?"), a("<think>\nTwo plus two.\n</think>\n\n4."), u("And 3+3?"),
                      a("<think>Three plus three.</think>6.")], None),
    "ends-with-user": ([s("Be brief."), u("Hi"), a("Hello."), u("Name a colour")], None),
}
KINDS = list(CONVERSATIONS)


def outcome(render):
    """The text ``render()`` gives, or the exception it raises."""
    try:
        return render()
    except Exception as exc:  # noqa: BLE001 - an official template's refusal, whatever its type
        return exc


def assert_same(name, builtin, official, where):
    """The built-in renders what the official template renders, or refuses (one line) what it refuses."""
    if isinstance(official, Exception):
        assert isinstance(builtin, FtcoreError), (where, builtin)
        message = str(builtin)
        assert "\n" not in message and f"template '{name}'" in message, where
        return
    if isinstance(builtin, FtcoreError) and "does not render tool schemas" in str(builtin):
        # The official template ignores `tools` (it has no place for them); ours says so rather
        # than training on a conversation whose tools the model never sees.
        return
    assert not isinstance(builtin, Exception), (where, builtin)
    assert builtin == official, where


# -- conformance with the official templates --------------------------------------------------

@pytest.mark.parametrize("gen", [False, True], ids=["whole", "generation-prompt"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(FAMILIES))
def test_renders_what_the_official_template_renders(name, kind, gen):
    messages, tools = CONVERSATIONS[kind]
    template = family(name)
    builtin = outcome(lambda: template.render(messages, None, add_generation_prompt=gen, tools=tools))
    # The embedded text, rendered by transformers with the model's own bos/eos.
    assert_same(name, builtin, outcome(lambda: official_render(template.template, messages, gen, tools,
                                                               **SPECIALS[name])), (kind, gen, "embedded"))
    for relative in OFFICIAL[name]:
        variables = dict(SPECIALS[name])
        if relative.endswith("Qwen3-0.6B.jinja") and any(not isinstance(m["content"], str) for m in messages):
            continue  # that earlier revision reads a None content as a string (and raises)
        if name == "deepseek-r1":
            # llama.cpp's copy is an edited one: it renders tool calls whenever there are some,
            # and closes the think block in the generation prompt unless enable_thinking is set.
            if any(m.get("tool_calls") for m in messages):
                continue
            variables["enable_thinking"] = True
        official = outcome(lambda: official_render(official_text(relative), messages, gen, tools, **variables))
        assert_same(name, builtin, official, (kind, gen, relative))


@pytest.mark.parametrize("name, relative", [("qwen3", "tokenizers/qwen3"),
                                            ("llama3.1", "templates/meta-llama-Llama-3.1-8B-Instruct.jinja"),
                                            ("tekken", "templates/mistralai-Mistral-Nemo-Instruct-2407.jinja"),
                                            ("gpt-oss", "templates/openai-gpt-oss-120b.jinja")],
                         ids=["qwen3", "llama3.1", "tekken", "gpt-oss"])
def test_builtin_template_is_the_official_one_verbatim(name, relative):
    assert family(name).template == official_text(relative)


@pytest.mark.parametrize("name, fixture", [("qwen3", "qwen3"), ("llama3.1", "llama3"), ("gemma3", "gemma-cropped")],
                         ids=["qwen3", "llama3.1", "gemma3"])
def test_renders_with_a_real_tokenizer_as_its_apply_chat_template_does(name, fixture):
    tok = real_tokenizer(fixture)
    template = family(name)
    for kind in ("system-multi-turn", "reasoning", "ends-with-user"):
        messages, _ = CONVERSATIONS[kind]
        for gen in (False, True):
            expected = outcome(lambda: tok.apply_chat_template(messages, chat_template=template.template,
                                                               tokenize=False, add_generation_prompt=gen))
            assert_same(name, outcome(lambda: template.render(messages, tok, add_generation_prompt=gen)),
                        expected, (kind, gen))


# -- exact renderings (the families without a fixture, and the quirks worth pinning) -----------

PIRATE = [s("You are a pirate."), u("Hello, how are you?"), a("Arr, fine."), u("Where is the gold?"), a("Buried.")]

LITERALS = {
    "gemma3": ("<bos><start_of_turn>user\nYou are a pirate.\n\nHello, how are you?<end_of_turn>\n"
               "<start_of_turn>model\nArr, fine.<end_of_turn>\n<start_of_turn>user\nWhere is the gold?<end_of_turn>\n"
               "<start_of_turn>model\nBuried.<end_of_turn>\n",
               "<bos><start_of_turn>user\nYou are a pirate.\n\nHello, how are you?<end_of_turn>\n"
               "<start_of_turn>model\nArr, fine.<end_of_turn>\n<start_of_turn>user\nWhere is the gold?<end_of_turn>\n"
               "<start_of_turn>model\n"),
    "phi4": ("<|im_start|>system<|im_sep|>You are a pirate.<|im_end|><|im_start|>user<|im_sep|>Hello, how are you?"
             "<|im_end|><|im_start|>assistant<|im_sep|>Arr, fine.<|im_end|><|im_start|>user<|im_sep|>Where is the "
             "gold?<|im_end|><|im_start|>assistant<|im_sep|>Buried.<|im_end|>",
             "<|im_start|>system<|im_sep|>You are a pirate.<|im_end|><|im_start|>user<|im_sep|>Hello, how are you?"
             "<|im_end|><|im_start|>assistant<|im_sep|>Arr, fine.<|im_end|><|im_start|>user<|im_sep|>Where is the "
             "gold?<|im_end|><|im_start|>assistant<|im_sep|>"),
    # The system message goes into the last user message, so only a conversation that ends with
    # that message has it (as shipped: a training conversation loses it); no generation prompt.
    "mistral-v3": ("<s>[INST] Hello, how are you?[/INST] Arr, fine.</s>[INST] Where is the gold?[/INST] Buried.</s>",
                   "<s>[INST] Hello, how are you?[/INST] Arr, fine.</s>[INST] You are a pirate.\n\nWhere is the "
                   "gold?[/INST]"),
    "tekken": ("<s>[INST]Hello, how are you?[/INST]Arr, fine.</s>[INST]Where is the gold?[/INST]Buried.</s>",
               "<s>[INST]Hello, how are you?[/INST]Arr, fine.</s>[INST]You are a pirate.\n\nWhere is the "
               "gold?[/INST]"),
    "deepseek-r1": ("<｜begin▁of▁sentence｜>You are a pirate.<｜User｜>Hello, how are you?<｜Assistant｜>Arr, fine."
                    "<｜end▁of▁sentence｜><｜User｜>Where is the gold?<｜Assistant｜>Buried.<｜end▁of▁sentence｜>",
                    "<｜begin▁of▁sentence｜>You are a pirate.<｜User｜>Hello, how are you?<｜Assistant｜>Arr, fine."
                    "<｜end▁of▁sentence｜><｜User｜>Where is the gold?<｜Assistant｜><think>\n"),
    "llama3.1": ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                 "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nYou are a pirate.<|eot_id|>"
                 "<|start_header_id|>user<|end_header_id|>\n\nHello, how are you?<|eot_id|>"
                 "<|start_header_id|>assistant<|end_header_id|>\n\nArr, fine.<|eot_id|>"
                 "<|start_header_id|>user<|end_header_id|>\n\nWhere is the gold?<|eot_id|>"
                 "<|start_header_id|>assistant<|end_header_id|>\n\nBuried.<|eot_id|>",
                 "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                 "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nYou are a pirate.<|eot_id|>"
                 "<|start_header_id|>user<|end_header_id|>\n\nHello, how are you?<|eot_id|>"
                 "<|start_header_id|>assistant<|end_header_id|>\n\nArr, fine.<|eot_id|>"
                 "<|start_header_id|>user<|end_header_id|>\n\nWhere is the gold?<|eot_id|>"
                 "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    # An empty think block on the last answer (after the last user message) only.
    "qwen3": ("<|im_start|>system\nYou are a pirate.<|im_end|>\n<|im_start|>user\nHello, how are you?<|im_end|>\n"
              "<|im_start|>assistant\nArr, fine.<|im_end|>\n<|im_start|>user\nWhere is the gold?<|im_end|>\n"
              "<|im_start|>assistant\n<think>\n\n</think>\n\nBuried.<|im_end|>\n",
              "<|im_start|>system\nYou are a pirate.<|im_end|>\n<|im_start|>user\nHello, how are you?<|im_end|>\n"
              "<|im_start|>assistant\nArr, fine.<|im_end|>\n<|im_start|>user\nWhere is the gold?<|im_end|>\n"
              "<|im_start|>assistant\n"),
}


@pytest.mark.parametrize("name", list(LITERALS))
def test_exact_rendering_of_a_two_exchange_conversation(name):
    whole, prompt = LITERALS[name]
    template = family(name)
    assert template.render(PIRATE) == whole
    assert template.render(PIRATE[:-1], add_generation_prompt=True) == prompt


def test_gpt_oss_exact_rendering_with_reasoning_and_todays_date():
    today = datetime.date.today().strftime("%Y-%m-%d")
    header = ("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
              f"Knowledge cutoff: 2024-06\nCurrent date: {today}\n\nReasoning: medium\n\n"
              "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
              "<|start|>developer<|message|># Instructions\n\nYou are a pirate.\n\n<|end|>")
    messages = [s("You are a pirate."), u("Hello?"), a("Arr.", reasoning_content="Greet back."), u("Gold?"),
                a("Buried.", reasoning_content="Say where.")]
    template = family("gpt-oss")
    # Earlier answers lose their reasoning and end with <|end|>; the last keeps it and ends with <|return|>.
    assert template.render(messages) == header + (
        "<|start|>user<|message|>Hello?<|end|><|start|>assistant<|channel|>final<|message|>Arr.<|end|>"
        "<|start|>user<|message|>Gold?<|end|><|start|>assistant<|channel|>analysis<|message|>Say where.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Buried.<|return|>")
    assert template.render(messages[:-1], add_generation_prompt=True) == header + (
        "<|start|>user<|message|>Hello?<|end|><|start|>assistant<|channel|>final<|message|>Arr.<|end|>"
        "<|start|>user<|message|>Gold?<|end|><|start|>assistant")
    # reasoning_effort is a template variable: the plan's chat_template_kwargs reach it.
    low = family("gpt-oss", chat_template_kwargs={"reasoning_effort": "low"}).render(messages[:2], None, True)
    assert "Reasoning: low\n\n" in low


def test_qwen3_reasoning_is_kept_after_the_last_user_message_and_dropped_before():
    messages, _ = CONVERSATIONS["reasoning"]
    text = family("qwen3").render(messages)
    assert text == ("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4.<|im_end|>\n"
                    "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
                    "<|im_start|>assistant\n<think>\nThree plus three is six.\n</think>\n\n6.<|im_end|>\n")
    inline, _ = CONVERSATIONS["think-inline"]
    # Reasoning written inline in the content is split off the same way.
    assert family("qwen3").render(inline) == text.replace("Three plus three is six.", "Three plus three.")


def test_qwen3_enable_thinking_false_from_the_plan_closes_the_think_block():
    messages = [u("Hi")]
    plain = family("qwen3").render(messages, None, add_generation_prompt=True)
    assert plain == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    no_think = family("qwen3", chat_template_kwargs={"enable_thinking": False})
    assert no_think.render(messages, None, add_generation_prompt=True) == plain + "<think>\n\n</think>\n\n"
    expected = official_render(official_text("tokenizers/qwen3"), messages, True, enable_thinking=False)
    assert no_think.render(messages, None, add_generation_prompt=True) == expected


def test_llama31_date_string_from_the_plan_replaces_the_default_date():
    messages = [u("Hi")]
    assert "Today Date: 26 Jul 2024\n" in family("llama3.1").render(messages)
    dated = family("llama3.1", chat_template_kwargs={"date_string": "01 Jan 2025"}).render(messages)
    assert "Today Date: 01 Jan 2025\n" in dated and "26 Jul 2024" not in dated


def test_llama31_puts_tools_into_the_first_user_message():
    messages, tools = CONVERSATIONS["tools"]
    text = family("llama3.1").render(messages, None, tools=tools)
    schema = json.dumps(TOOLS[0], indent=4)
    assert ("<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
            "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
            "You help with weather.<|eot_id|>") in text
    assert ("<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please respond with a "
            "JSON for a function call with its proper arguments that best answers the given prompt.\n\n"
            'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
            f'value}}.Do not use variables.\n\n{schema}\n\nWeather in Paris?<|eot_id|>') in text
    assert ('<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Paris"}}'
            "<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n\"{\\\"temp\\\": 21}\"<|eot_id|>") in text


def test_mistral_v3_renders_tool_schemas_calls_and_results():
    messages, tools = CONVERSATIONS["tools"]
    text = family("mistral-v3").render(messages, None, tools=tools)
    # The system message is gone: it goes into the last user message only when that ends the conversation.
    assert text == (
        '<s>[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "get_weather", "description": '
        '"Get the current weather in a city.", "parameters": {"type": "object", "properties": {"city": '
        '{"type": "string", "description": "The city."}}, "required": ["city"]}}}][/AVAILABLE_TOOLS]'
        '[INST] Weather in Paris?[/INST]'
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call12345"}]</s>'
        '[TOOL_RESULTS] {"content": {"temp": 21}, "call_id": "call12345"}[/TOOL_RESULTS]'
        ' It is 21 degrees in Paris.</s>')


def test_deepseek_r1_as_shipped_cuts_think_and_renders_tool_calls_only_without_content():
    text = family("deepseek-r1").render(CONVERSATIONS["think-inline"][0])
    # Only "</think>" and what precedes it go: the blank line after it stays.
    assert text == ("<｜begin▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜>\n\n4.<｜end▁of▁sentence｜>"
                    "<｜User｜>And 3+3?<｜Assistant｜>6.<｜end▁of▁sentence｜>")
    messages, _ = CONVERSATIONS["tool-calls-without-schema"]
    assert family("deepseek-r1").render(messages, None, add_generation_prompt=False) == (
        "<｜begin▁of▁sentence｜><｜User｜>Weather in Paris?<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
        'function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>'
        '<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{"temp": 21}<｜tool▁output▁end｜><｜tool▁outputs▁end｜>'
        "21 degrees.<｜end▁of▁sentence｜>")


# -- refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, messages, says", [
    ("gemma3", [u("Hi"), u("Hello?")], "alternate"),
    ("gemma3", [u("Weather in Paris?"), a("", tool_calls=[CALL]), RESULT], "alternate"),
    ("mistral-v3", [u("Hi"), u("Hello?")], "alternate"),
    ("tekken", [u("Hi"), a("", tool_calls=[{**CALL, "id": "c1"}])], "length 9"),
    ("llama3.1", [u("Hi"), a("", tool_calls=[CALL, CALL])], "single tool-calls"),
    ("gpt-oss", [u("Hi"), RESULT], "no previous assistant message with a tool call"),
], ids=["gemma3-roles", "gemma3-tool", "mistral-v3-roles", "tekken-call-id", "llama3.1-two-calls", "gpt-oss-tool"])
def test_what_the_official_template_refuses_is_a_one_line_error(name, messages, says):
    with pytest.raises(FtcoreError, match=f"template '{name}' cannot render.*{says}") as info:
        family(name).render(messages)
    assert "\n" not in str(info.value)


# -- listing and prepare ---------------------------------------------------------------------------


def test_plugins_lists_the_new_families(tmp_path):
    result = run_cli("plugins", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    listed = {c["name"]: c for c in json.loads(result.stdout)["components"]["chat template"]}
    for name, (module, _) in FAMILIES.items():
        assert listed[name]["plugin"] == f"ftcore_plugins.templates.{module}"
        assert listed[name]["dist"] == "ftcore"


def tiny_model(vocab_size):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(config)


# Each family on a real tokenizer that lacks some of its tokens, and the tokens it must add.
PREPARE = {
    "qwen3": ("qwen25", {"<think>", "</think>", "<tool_response>", "</tool_response>"}),
    "llama3.1": ("llama3", {"<|python_tag|>", "<|eom_id|>"}),
    "mistral-v3": ("llama3", {"[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]",
                              "[TOOL_RESULTS]", "[/TOOL_RESULTS]"}),
    "tekken": ("qwen3", {"[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]",
                         "[TOOL_RESULTS]", "[/TOOL_RESULTS]"}),
    "gemma3": ("llama3", {"<start_of_turn>", "<end_of_turn>"}),
    "phi4": ("qwen25", {"<|im_sep|>"}),
    "deepseek-r1": ("qwen25", {"<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "<｜tool▁calls▁begin｜>",
                               "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
                               "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                               "<｜tool▁output▁end｜>", "<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>"}),
    "gpt-oss": ("qwen3", {"<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>"}),
}


@pytest.mark.parametrize("name", list(PREPARE))
def test_prepare_adds_the_missing_tokens_to_a_real_tokenizer(name):
    from transformers import AutoTokenizer

    fixture, added = PREPARE[name]
    tok = AutoTokenizer.from_pretrained(shared(f"tokenizers/{fixture}"))
    before, vocab, had_bos = len(tok), tok.get_vocab(), tok.bos_token
    assert added.isdisjoint(vocab)
    template = family(name)
    model, tok = template.prepare(tiny_model(before), tok)

    assert len(tok) == before + len(added)
    assert set(tok.get_vocab()) - set(vocab) == added
    assert model.get_input_embeddings().weight.shape[0] == len(tok)
    if had_bos is None and template.bos_token is not None:  # the template writes bos_token: it gets its own
        assert tok.bos_token == template.bos_token
    for token in [*template.required_tokens(), *added]:
        ids = tok(token, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1, token
    end = template.end_of_turn(tok)
    eos = model.generation_config.eos_token_id
    assert tok.convert_tokens_to_ids(end) in ([eos] if isinstance(eos, int) else eos)
    # The tokenizer now renders as training does, with its own chat template.
    assert tok.chat_template == template.chat_template()
    messages, _ = CONVERSATIONS["multi-turn"]
    for gen, msgs in ((False, messages), (True, messages[:-1])):
        assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen) == \
            template.render(msgs, tok, add_generation_prompt=gen)


def test_gpt_oss_stops_generation_at_return_not_at_the_end_of_its_reasoning():
    template = family("gpt-oss")
    assert template.end_of_turn() == "<|return|>"
    assert template.stop_tokens == ("<|return|>", "<|call|>")  # generation goes on after the analysis' <|end|>
    from ftcore_plugins.common.spans import SpanLocator

    # ... while the span locator still closes history turns (and the analysis message) with <|end|>
    assert "<|end|>" in SpanLocator(template, None).end_tokens()
