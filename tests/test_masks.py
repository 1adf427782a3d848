"""Assistant-only labels: every assistant turn, its end-of-turn token, nothing else."""

from __future__ import annotations

import json

import pytest

from conftest import SHARED

pytest.importorskip("transformers")

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Name a colour"},
    {"role": "assistant", "content": "Blue, like the sea."},
]


def labelled_text(tokenizer, template, messages, **kw):
    import datasets

    from ftcore_plugins.common.chat import IGNORE, encode

    cols, stats = encode(datasets.Dataset.from_list([{"messages": messages}]), tokenizer, template,
                         max_length=kw.pop("max_length", None), **kw)
    if not cols["input_ids"]:
        return None, stats
    ids, labels = cols["input_ids"][0], cols["labels"][0]
    # The labelled tokens, decoded as contiguous runs.
    runs, current = [], []
    for t, lab in zip(ids, labels):
        if lab != IGNORE:
            assert lab == t
            current.append(t)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs, stats


def real_tokenizer(name):
    folder = SHARED / "tokenizers" / name
    if not folder.exists():
        pytest.skip(f"../shared/fixtures/tokenizers/{name} not present")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def test_chatml_labels_every_assistant_turn_with_im_end_when_pad_is_eos():
    from ftcore_plugins.templates.chatml import ChatMLTemplate

    tok = real_tokenizer("qwen25")
    tok.pad_token = tok.eos_token  # the case that silently drops EOS labels in naive collators
    runs, _ = labelled_text(tok, ChatMLTemplate(), CONVERSATION)
    assert runs == ["Hello.<|im_end|>", "Blue, like the sea.<|im_end|>"]


def test_native_llama3_labels_eot_id():
    from ftcore_plugins.templates.native import NativeTemplate

    tok = real_tokenizer("llama3")
    tok.pad_token = tok.eos_token
    runs, _ = labelled_text(tok, NativeTemplate(), CONVERSATION)
    assert runs == ["Hello.<|eot_id|>", "Blue, like the sea.<|eot_id|>"]


def test_native_qwen_matches_chatml_rendering():
    from ftcore_plugins.templates.chatml import ChatMLTemplate
    from ftcore_plugins.templates.native import NativeTemplate

    tok = real_tokenizer("qwen25")
    for gen in (False, True):
        msgs = CONVERSATION if not gen else CONVERSATION[:-1]
        assert NativeTemplate().render(msgs, tok, gen) == ChatMLTemplate().render(msgs, tok, gen)


def test_train_on_inputs_labels_everything():
    from ftcore_plugins.templates.chatml import ChatMLTemplate

    tok = real_tokenizer("qwen25")
    runs, _ = labelled_text(tok, ChatMLTemplate(), CONVERSATION, train_on_inputs=True)
    assert runs == [ChatMLTemplate().render(CONVERSATION)]


def test_truncation_that_leaves_no_answer_drops_the_sample():
    from ftcore_plugins.templates.chatml import ChatMLTemplate

    tok = real_tokenizer("qwen25")
    runs, stats = labelled_text(tok, ChatMLTemplate(), CONVERSATION[:3], max_length=8)
    assert runs is None and stats.dropped_no_labels == 1 and stats.truncated == 1


def test_gemma_native_template_rejects_system_role_clearly():
    from ftcore.errors import FtcoreError
    from ftcore_plugins.templates.native import NativeTemplate

    folder = SHARED / "tokenizers" / "gemma-cropped"
    if not folder.exists():
        pytest.skip("../shared/fixtures/tokenizers/gemma-cropped not present")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    assert config.get("chat_template")
    with pytest.raises(FtcoreError, match="template 'native'"):
        NativeTemplate().render(CONVERSATION, tok)
