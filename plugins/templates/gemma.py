"""Chat template ``gemma``: Gemma's ``<start_of_turn>``/``<end_of_turn>`` turns, no system role."""

from __future__ import annotations

import ftcore
from ftcore_plugins.templates._base import JinjaTemplate, NoSystemOptions

# Gemma (1 and 2) instruction-tuned models' own chat template, verbatim. It rejects a
# system message and trims each message's content; the assistant's role is "model".
TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)


class GemmaTemplate(JinjaTemplate):
    """Gemma: <start_of_turn>user|model ... <end_of_turn>; no system role (see the `system` option)."""

    name = "gemma"
    Options = NoSystemOptions
    template = TEMPLATE
    special_tokens = ("<start_of_turn>", "<end_of_turn>")
    stop_tokens = ("<end_of_turn>",)
    bos_token = "<bos>"
    system_role = False


@ftcore.hookimpl
def register_chat_templates(register):
    register(GemmaTemplate)
