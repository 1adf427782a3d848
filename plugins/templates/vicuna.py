"""Chat template ``vicuna``: Vicuna v1.1's ``USER: ... ASSISTANT: ...</s>`` format."""

from __future__ import annotations

import ftcore
from ftcore_plugins.templates._base import JinjaTemplate

DEFAULT_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
                  "The assistant gives helpful, detailed, and polite answers to the user's questions.")

# FastChat's "vicuna_v1.1" conversation, as a chat template:
# "<s>{system} USER: {user} ASSISTANT: {answer}</s>USER: ... ASSISTANT:". Without a
# system message, FastChat's default one is used; an empty one renders nothing.
TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system_message = messages[0]['content'] -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set system_message = \"" + DEFAULT_SYSTEM + "\" -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{{- bos_token -}}"
    "{%- if system_message -%}{{- system_message + ' ' -}}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if message['role'] == 'user' -%}{{- 'USER: ' + message['content'] + ' ' -}}"
    "{%- elif message['role'] == 'assistant' -%}{{- 'ASSISTANT: ' + message['content'] + eos_token -}}"
    "{%- else -%}{{- raise_exception('vicuna supports a first system message, then user and assistant "
    "messages only') -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'ASSISTANT:' -}}{%- endif -%}"
)


class VicunaTemplate(JinjaTemplate):
    """Vicuna v1.1 (FastChat): a system line, then USER: / ASSISTANT: turns, answers closed by EOS."""

    name = "vicuna"
    template = TEMPLATE
    bos_token = "<s>"
    eos_token = "</s>"


@ftcore.hookimpl
def register_chat_templates(register):
    register(VicunaTemplate)
