"""Chat template ``mistral``: Mistral Instruct's ``[INST]`` turns, no system role."""

from __future__ import annotations

import ftcore
from ftcore_plugins.templates._base import JinjaTemplate, NoSystemOptions

# The chat template of Mistral-7B-Instruct-v0.1/v0.2 and Mixtral-8x7B-Instruct-v0.1,
# verbatim: "<s>[INST] user [/INST]answer</s>[INST] ...". It rejects a system message
# (see the `system` option) and has no separate generation prompt.
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)


class MistralTemplate(JinjaTemplate):
    """Mistral Instruct v0.1/v0.2 and Mixtral 8x7B: INST blocks, answers closed by EOS; no system role."""

    name = "mistral"
    Options = NoSystemOptions
    template = TEMPLATE
    bos_token = "<s>"
    eos_token = "</s>"
    system_role = False


@ftcore.hookimpl
def register_chat_templates(register):
    register(MistralTemplate)
