"""Chat template ``zephyr``: Zephyr's ``<|role|>`` turns, each closed by EOS."""

from __future__ import annotations

import ftcore
from ftcore_plugins.templates._base import JinjaTemplate

# HuggingFaceH4/zephyr-7b-beta's chat template, verbatim: "<|role|>\ncontent</s>\n" per
# message, "<|assistant|>\n" as the generation prompt. The role markers are plain text
# (Zephyr's tokenizer has no such tokens), so none are added.
TEMPLATE = (
    "{% for message in messages %}\n"
    "{% if message['role'] == 'user' %}\n"
    "{{ '<|user|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'system' %}\n"
    "{{ '<|system|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'assistant' %}\n"
    "{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n"
    "{% endif %}\n"
    "{% if loop.last and add_generation_prompt %}\n"
    "{{ '<|assistant|>' }}\n"
    "{% endif %}\n"
    "{% endfor %}"
)


class ZephyrTemplate(JinjaTemplate):
    """Zephyr: <|system|>/<|user|>/<|assistant|> lines, each message closed by </s>."""

    name = "zephyr"
    template = TEMPLATE
    eos_token = "</s>"


@ftcore.hookimpl
def register_chat_templates(register):
    register(ZephyrTemplate)
