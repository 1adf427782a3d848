"""Chat template ``llama3``: Llama 3 Instruct's header/``<|eot_id|>`` turns."""

from __future__ import annotations

import ftcore
from ftcore_plugins.templates._base import JinjaTemplate

# Meta-Llama-3-8B-Instruct's own chat template, verbatim. It trims each message's content.
TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


class Llama3Template(JinjaTemplate):
    """Llama 3 Instruct: <|start_header_id|>role<|end_header_id|> turns closed by <|eot_id|>."""

    name = "llama3"
    template = TEMPLATE
    special_tokens = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
    stop_tokens = ("<|eot_id|>",)
    bos_token = "<|begin_of_text|>"


@ftcore.hookimpl
def register_chat_templates(register):
    register(Llama3Template)
