"""Built-in chat template families: conformance with real tokenizers' own templates,
exact formats, prefix-stable rendering for assistant-only labels, and ``prepare``."""

from __future__ import annotations

import functools
import importlib

import pytest

from conftest import SHARED

pytest.importorskip("transformers")

from ftcore.errors import FtcoreError  # noqa: E402

FAMILIES = {
    "chatml": ("templates.chatml", "ChatMLTemplate"),
    "llama2": ("templates.llama2", "Llama2Template"),
    "llama3": ("templates.llama3", "Llama3Template"),
    "mistral": ("templates.mistral", "MistralTemplate"),
    "gemma": ("templates.gemma", "GemmaTemplate"),
    "phi3": ("templates.phi3", "Phi3Template"),
    "qwen2.5": ("templates.qwen25", "Qwen25Template"),
    "alpaca": ("templates.alpaca", "AlpacaTemplate"),
    "vicuna": ("templates.vicuna", "VicunaTemplate"),
    "zephyr": ("templates.zephyr", "ZephyrTemplate"),
}
NO_SYSTEM = {"gemma", "mistral"}

# What render_with_spans labels for an assistant turn: text before the content (the
# formats that put a space between the prompt and the answer), and the end-of-turn marker.
SPAN = {
    "chatml": ("", "<|im_end|>"),
    "llama2": (" ", " </s>"),
    "llama3": ("", "<|eot_id|>"),
    "mistral": ("", "</s>"),
    "gemma": ("", "<end_of_turn>"),
    "phi3": ("", "<|end|>"),
    "qwen2.5": ("", "<|im_end|>"),
    "alpaca": ("", "</s>"),
    "vicuna": (" ", "</s>"),
    "zephyr": ("", "</s>"),
    "jinja": ("", "<|im_end|>"),
}

CHATML_JINJA = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def family(name, **options):
    module, cls_name = FAMILIES[name]
    cls = getattr(importlib.import_module(f"ftcore_plugins.{module}"), cls_name)
    return cls(cls.Options(**options))


def jinja_family(tmp_path, text=CHATML_JINJA, **options):
    from ftcore_plugins.templates.jinja import JinjaFileTemplate

    path = tmp_path / "chat.jinja"
    path.write_text(text, encoding="utf-8")
    return JinjaFileTemplate(JinjaFileTemplate.Options(path=path, **options))


def fixture_folder(name):
    folder = SHARED / "tokenizers" / name
    if not folder.exists():
        pytest.skip(f"../shared/fixtures/tokenizers/{name} not present")
    return folder


@functools.lru_cache(maxsize=None)
def _load(name):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SHARED / "tokenizers" / name)


def real_tokenizer(name):
    """A shared, read-only instance: tests that change a tokenizer load their own."""
    fixture_folder(name)
    return _load(name)


def u(content):
    return {"role": "user", "content": content}


def a(content):
    return {"role": "assistant", "content": content}


def s(content):
    return {"role": "system", "content": content}


CONVERSATIONS = {
    "one-exchange": [u("Hi"), a("Hello!")],
    "multi-turn": [u("Hi there"), a("Hello."), u("Name a colour"), a("Blue, like the sea."),
                   u("And another?"), a("Green.")],
    "system": [s("You are terse."), u("Hi there"), a("Hello."), u("Name a colour"), a("Blue.")],
    "whitespace-and-unicode": [
        s("  Réponds en français.\n"),
        u("  Quelle heure est-il ?\nSoyez bref.  "),
        a("\nIl est midi. ☀️ 🚀\n\n"),
        u("日本語で「こんにちは」は？\t"),
        a("  こんにちは — «hello» — Ωμέγα  "),
    ],
    "markdown-and-code": [
        u("Write a function:\n\n```python\ndef f(x):\n    return x\n```\n"),
        a("Here:\n\n```python\ndef f(x: int) -> int:\n    return x + 1\n```"),
        u("Thanks!"),
    ],
}


def without_system(messages):
    return [m for m in messages if m["role"] != "system"]


# -- conformance with the real tokenizers' own templates ----------------------------------

CONFORMANCE = [("llama3", "llama3"), ("qwen2.5", "qwen25"), ("gemma", "gemma-cropped")]


@pytest.mark.parametrize("name, fixture", CONFORMANCE, ids=[c[0] for c in CONFORMANCE])
@pytest.mark.parametrize("conversation", list(CONVERSATIONS), ids=list(CONVERSATIONS))
def test_renders_exactly_what_the_real_tokenizer_renders(name, fixture, conversation):
    tok = real_tokenizer(fixture)
    messages = CONVERSATIONS[conversation]
    if name in NO_SYSTEM:
        messages = without_system(messages)
    template = family(name)
    # Every prefix, with and without the generation prompt: whole conversations, prompts
    # for the next answer, and the odd "prompt after an answer".
    for k in range(1, len(messages) + 1):
        for gen in (False, True):
            expected = tok.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=gen)
            assert template.render(messages[:k], tok, add_generation_prompt=gen) == expected, (k, gen)
            # Without a tokenizer, the family's own bos/eos stand in and give the same text.
            assert template.render(messages[:k], None, add_generation_prompt=gen) == expected, (k, gen)


@pytest.mark.parametrize("name, fixture", CONFORMANCE, ids=[c[0] for c in CONFORMANCE])
def test_builtin_template_is_the_official_one_verbatim(name, fixture):
    assert family(name).template == real_tokenizer(fixture).chat_template


def test_qwen25_inserts_its_default_system_prompt_like_the_real_one():
    tok = real_tokenizer("qwen25")
    messages = [u("Hi")]
    text = family("qwen2.5").render(messages, tok, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                    "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert text == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_gemma_rejects_a_system_message_by_default_like_the_real_template():
    tok = real_tokenizer("gemma-cropped")
    messages = CONVERSATIONS["system"]
    with pytest.raises(Exception, match="System role not supported"):
        tok.apply_chat_template(messages, tokenize=False)
    with pytest.raises(FtcoreError) as info:
        family("gemma").render(messages, tok)
    message = str(info.value)
    assert "\n" not in message
    assert "template 'gemma'" in message and 'system = "merge"' in message


@pytest.mark.parametrize("conversation", ["system", "whitespace-and-unicode"])
def test_gemma_merge_prepends_the_system_message_to_the_first_user_turn(conversation):
    tok = real_tokenizer("gemma-cropped")
    messages = CONVERSATIONS[conversation]
    system, first, rest = messages[0], messages[1], messages[2:]
    merged = [u(system["content"] + "\n\n" + first["content"]), *rest]
    template = family("gemma", system="merge")
    for gen in (False, True):
        expected = tok.apply_chat_template(merged, tokenize=False, add_generation_prompt=gen)
        assert template.render(messages, tok, add_generation_prompt=gen) == expected
    # Conversations without a system message are unchanged by the option.
    plain = without_system(messages)
    assert template.render(plain, tok) == tok.apply_chat_template(plain, tokenize=False)


@pytest.mark.parametrize("name", sorted(NO_SYSTEM))
def test_a_later_system_message_is_an_error_even_when_merging(name):
    messages = [u("Hi"), a("Hello."), s("Now be rude."), u("Hi again")]
    for system in ("error", "merge"):
        with pytest.raises(FtcoreError, match=f"template '{name}'.*message 2"):
            family(name, system=system).render(messages)


def test_a_conversation_the_format_cannot_express_is_a_one_line_error():
    with pytest.raises(FtcoreError, match="template 'mistral' cannot render.*alternate") as info:
        family("mistral").render([u("Hi"), u("Hello?")])
    assert "\n" not in str(info.value)


# -- exact formats of the families without a fixture ----------------------------------------

PIRATE = [s("You are a pirate."), u("Hello, how are you?"), a("Arr, fine."), u("Where is the gold?"), a("Buried.")]

LITERALS = {
    "llama2": ("<s>[INST] <<SYS>>\nYou are a pirate.\n<</SYS>>\n\nHello, how are you? [/INST] Arr, fine. </s>"
               "<s>[INST] Where is the gold? [/INST] Buried. </s>",
               "<s>[INST] <<SYS>>\nYou are a pirate.\n<</SYS>>\n\nHello, how are you? [/INST] Arr, fine. </s>"
               "<s>[INST] Where is the gold? [/INST]"),
    "mistral": ("<s>[INST] Hello, how are you? [/INST]Arr, fine.</s>[INST] Where is the gold? [/INST]Buried.</s>",
                "<s>[INST] Hello, how are you? [/INST]Arr, fine.</s>[INST] Where is the gold? [/INST]"),
    "phi3": ("<|system|>\nYou are a pirate.<|end|>\n<|user|>\nHello, how are you?<|end|>\n<|assistant|>\n"
             "Arr, fine.<|end|>\n<|user|>\nWhere is the gold?<|end|>\n<|assistant|>\nBuried.<|end|>\n",
             "<|system|>\nYou are a pirate.<|end|>\n<|user|>\nHello, how are you?<|end|>\n<|assistant|>\n"
             "Arr, fine.<|end|>\n<|user|>\nWhere is the gold?<|end|>\n<|assistant|>\n"),
    "zephyr": ("<|system|>\nYou are a pirate.</s>\n<|user|>\nHello, how are you?</s>\n<|assistant|>\n"
               "Arr, fine.</s>\n<|user|>\nWhere is the gold?</s>\n<|assistant|>\nBuried.</s>\n",
               "<|system|>\nYou are a pirate.</s>\n<|user|>\nHello, how are you?</s>\n<|assistant|>\n"
               "Arr, fine.</s>\n<|user|>\nWhere is the gold?</s>\n<|assistant|>\n"),
    "vicuna": ("<s>You are a pirate. USER: Hello, how are you? ASSISTANT: Arr, fine.</s>"
               "USER: Where is the gold? ASSISTANT: Buried.</s>",
               "<s>You are a pirate. USER: Hello, how are you? ASSISTANT: Arr, fine.</s>"
               "USER: Where is the gold? ASSISTANT:"),
    "alpaca": ("You are a pirate.\n\n### Instruction:\nHello, how are you?\n\n### Response:\nArr, fine.</s>"
               "\n\n### Instruction:\nWhere is the gold?\n\n### Response:\nBuried.</s>",
               "You are a pirate.\n\n### Instruction:\nHello, how are you?\n\n### Response:\nArr, fine.</s>"
               "\n\n### Instruction:\nWhere is the gold?\n\n### Response:\n"),
}


@pytest.mark.parametrize("name", list(LITERALS))
def test_exact_format_of_a_two_exchange_conversation(name):
    whole, prompt = LITERALS[name]
    template = family(name)
    messages = without_system(PIRATE) if name in NO_SYSTEM else PIRATE
    assert template.render(messages) == whole
    assert template.render(messages[:-1], add_generation_prompt=True) == prompt


def test_mistral_merge_joins_system_and_first_user_message_with_a_blank_line():
    assert family("mistral", system="merge").render(PIRATE) == (
        "<s>[INST] You are a pirate.\n\nHello, how are you? [/INST]Arr, fine.</s>"
        "[INST] Where is the gold? [/INST]Buried.</s>")


def test_default_system_prompts_of_vicuna_and_alpaca():
    messages = [u("Hi"), a("Hello.")]
    assert family("vicuna").render(messages) == (
        "<s>A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, "
        "detailed, and polite answers to the user's questions. USER: Hi ASSISTANT: Hello.</s>")
    assert family("alpaca").render(messages) == (
        "Below is an instruction that describes a task. Write a response that appropriately completes the "
        "request.\n\n### Instruction:\nHi\n\n### Response:\nHello.</s>")


def test_bos_and_eos_come_from_the_tokenizer():
    tok = real_tokenizer("gemma-cropped")  # bos "<bos>", eos "<eos>"
    assert family("llama2").render([u("Hi"), a("Hello.")], tok) == "<bos>[INST] Hi [/INST] Hello. <eos>"
    qwen = real_tokenizer("qwen25")  # no bos: alpaca starts without one
    assert family("alpaca").render([u("Hi"), a("Hello.")], qwen).startswith("Below is")
    assert family("alpaca").render([u("Hi"), a("Hello.")], qwen).endswith("Hello.<|im_end|>")


def test_chatml_python_rendering_equals_its_jinja():
    template = family("chatml")
    for messages in CONVERSATIONS.values():
        for gen in (False, True):
            assert template.render(messages, None, gen) == super(type(template), template).render(messages, None, gen)


# -- prefix-stable rendering: assistant spans for the loss mask ------------------------------

THREE_EXCHANGES = [s("Be brief."), u("Hi"), a("Hello."), u("Name a colour"), a("Blue, like the sea."),
                   u("Another one?"), a("Green:\nlike grass.")]


@pytest.mark.parametrize("name", [*FAMILIES, "jinja"])
def test_every_family_renders_prefix_by_prefix_so_assistant_spans_are_found(name, tmp_path):
    from ftcore_plugins.common.chat import render_with_spans

    template = jinja_family(tmp_path, stop_tokens=["<|im_end|>"]) if name == "jinja" else family(name)
    messages = without_system(THREE_EXCHANGES) if name in NO_SYSTEM else THREE_EXCHANGES
    text, spans = render_with_spans(template, messages, None)
    lead, end = SPAN[name]
    assert [text[i:j] for i, j in spans] == [lead + m["content"] + end for m in messages if m["role"] == "assistant"]
    assert end.endswith(template.end_of_turn(None))
    if name in NO_SYSTEM:  # and with a merged system message
        text, spans = render_with_spans(family(name, system="merge"), THREE_EXCHANGES, None)
        assert [text[i:j] for i, j in spans] == [lead + m["content"] + end for m in messages
                                                 if m["role"] == "assistant"]


def labelled_runs(tokenizer, template, messages):
    import datasets

    from ftcore_plugins.common.chat import IGNORE, encode

    cols, _ = encode(datasets.Dataset.from_list([{"messages": messages}]), tokenizer, template, max_length=None)
    runs, current = [], []
    for t, lab in zip(cols["input_ids"][0], cols["labels"][0]):
        if lab != IGNORE:
            assert lab == t
            current.append(t)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


@pytest.mark.parametrize("name, fixture, end", [("llama3", "llama3", "<|eot_id|>"),
                                                ("qwen2.5", "qwen25", "<|im_end|>")], ids=["llama3", "qwen2.5"])
def test_assistant_only_labels_end_with_the_end_of_turn_token_when_pad_is_eos(name, fixture, end):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(fixture_folder(fixture))
    tok.pad_token = tok.eos_token  # the case that silently drops EOS labels in naive collators
    messages = [s("You are terse."), u("Hi there"), a("Hello."), u("Name a colour"), a("Blue, like the sea.")]
    assert labelled_runs(tok, family(name), messages) == [f"Hello.{end}", f"Blue, like the sea.{end}"]
    end_id = tok.convert_tokens_to_ids(end)
    assert end_id == tok.eos_token_id  # both fixtures' EOS is their end-of-turn token
    # Without a system message Qwen's default one is rendered, and not trained on either.
    assert labelled_runs(tok, family(name), messages[1:]) == [f"Hello.{end}", f"Blue, like the sea.{end}"]


# -- prepare -------------------------------------------------------------------------------


def bare_tokenizer():
    """A tiny tokenizer with none of the families' special tokens, and no bos/eos."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "hi", "hello", "blue", "a", "b"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def tiny_model(vocab_size):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(config)


@pytest.mark.parametrize("name", [*FAMILIES, "jinja"])
def test_prepare_adds_missing_tokens_grows_embeddings_and_ships_the_template(name, tmp_path):
    template = (jinja_family(tmp_path, stop_tokens=["<|im_end|>"], special_tokens=["<|im_start|>"])
                if name == "jinja" else family(name))
    tok = bare_tokenizer()
    before = len(tok)
    model = tiny_model(before)
    model, tok = template.prepare(model, tok)

    assert len(tok) > before
    assert model.get_input_embeddings().weight.shape[0] == len(tok)
    needed = [*template.required_tokens(),
              *(getattr(tok, k) for k in ("bos_token", "eos_token")
                if k in template.chat_template() and getattr(tok, k) is not None)]
    assert needed
    for token in needed:
        ids = tok(token, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and ids[0] != tok.unk_token_id, token
    end_id = tok.convert_tokens_to_ids(template.end_of_turn(tok))
    eos = model.generation_config.eos_token_id
    assert end_id in ([eos] if isinstance(eos, int) else eos)
    # The tokenizer now renders as training did, with its own chat template.
    assert tok.chat_template == template.chat_template()
    messages = without_system(THREE_EXCHANGES) if name in NO_SYSTEM else THREE_EXCHANGES
    for gen in (False, True):
        msgs = messages if not gen else messages[:-1]
        assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen) == \
            template.render(msgs, tok, add_generation_prompt=gen)


def test_prepare_with_merge_ships_a_template_that_merges():
    tok = bare_tokenizer()
    template = family("gemma", system="merge")
    model, tok = template.prepare(tiny_model(len(tok)), tok)
    rendered = tok.apply_chat_template(THREE_EXCHANGES, tokenize=False)
    assert rendered == template.render(THREE_EXCHANGES, tok)
    assert rendered.startswith("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n")


def test_prepare_leaves_a_complete_tokenizer_and_spare_embedding_rows_alone():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(fixture_folder("gemma-cropped"))
    before = len(tok)
    model, tok = family("gemma").prepare(tiny_model(before), tok)
    assert len(tok) == before and model.get_input_embeddings().weight.shape[0] == before
    # A model with more rows than the tokenizer has tokens (as Qwen's) is never shrunk.
    tok = bare_tokenizer()
    model, tok = family("chatml").prepare(tiny_model(64), tok)
    assert len(tok) < 64 and model.get_input_embeddings().weight.shape[0] == 64


# -- jinja: a template file ------------------------------------------------------------------


def test_jinja_template_loads_a_file_and_renders_it(tmp_path):
    template = jinja_family(tmp_path)
    for messages in CONVERSATIONS.values():
        for gen in (False, True):
            assert template.render(messages, None, gen) == family("chatml").render(messages, None, gen)
    tok = real_tokenizer("qwen25")
    assert template.render(CONVERSATIONS["system"], tok) == family("chatml").render(CONVERSATIONS["system"])
    assert template.check(None) == []


def test_jinja_template_sees_the_tokenizers_special_tokens(tmp_path):
    template = jinja_family(tmp_path, text="{{ bos_token }}{% for m in messages %}{{ m['content'] + eos_token }}"
                                           "{% endfor %}")
    assert template.render([u("Hi"), a("Hello.")], real_tokenizer("gemma-cropped")) == "<bos>Hi<eos>Hello.<eos>"


def test_a_malformed_jinja_file_is_a_one_line_error_naming_the_file(tmp_path):
    template = jinja_family(tmp_path, text="{% for message in messages %}\n{{ message['content'] }\n")
    path = str(tmp_path / "chat.jinja")
    with pytest.raises(FtcoreError) as info:
        template.render([u("Hi")])
    message = str(info.value)
    assert "\n" not in message and path in message and "template 'jinja'" in message
    problems = template.check(None)
    assert len(problems) == 1 and problems[0].startswith("path: ") and path in problems[0]


def test_a_malformed_jinja_file_fails_plan_validation(tmp_path):
    from ftcore.errors import PlanError
    from ftcore.plan import load_plan
    from ftcore.plugins import get_plugin_manager

    (tmp_path / "chat.jinja").write_text("{% if add_generation_prompt %}oops", encoding="utf-8")
    (tmp_path / "chat.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}, '
                                         '{"role": "assistant", "content": "hello"}]}\n', encoding="utf-8")
    plan = tmp_path / "plan.toml"
    plan.write_text('[model]\nuse = "scratch"\ntokenizer_data = ["chat"]\n\n'
                    '[template]\nuse = "jinja"\npath = "chat.jinja"\n\n'
                    '[data.chat]\nuse = "jsonl"\npath = "chat.jsonl"\n\n'
                    '[[stage]]\ntrainer = "sft"\ndata = "chat"\n', encoding="utf-8")
    registry = get_plugin_manager(entry_points=False).registry()
    with pytest.raises(PlanError) as info:
        load_plan(plan, registry)
    assert len(info.value.problems) == 1, info.value.problems
    problem = info.value.problems[0]
    assert "template.path" in problem and str(tmp_path / "chat.jinja") in problem
    # The same plan with a good template validates.
    (tmp_path / "chat.jinja").write_text(CHATML_JINJA, encoding="utf-8")
    assert load_plan(plan, registry).template.name == "jinja"
