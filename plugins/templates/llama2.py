"""Chat template ``llama2``: Llama 2 Chat's ``[INST]`` turns with a ``<<SYS>>`` block."""

from __future__ import annotations

import ftcore
from ftcore_plugins.templates._base import JinjaTemplate

# meta-llama/Llama-2-7b-chat-hf's chat template, verbatim: every exchange is
# "<s>[INST] user [/INST] answer </s>", the system message sits in a <<SYS>> block at the
# start of the first user turn, and content is stripped. There is no separate generation
# prompt: a conversation ending in a user turn already ends with "[/INST]".
TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)


class Llama2Template(JinjaTemplate):
    """Llama 2 Chat: INST blocks, the system message in a <<SYS>> block, answers closed by EOS."""

    name = "llama2"
    template = TEMPLATE
    bos_token = "<s>"
    eos_token = "</s>"


@ftcore.hookimpl
def register_chat_templates(register):
    register(Llama2Template)
