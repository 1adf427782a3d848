"""Chat template ``gemma3``: Gemma 3's ``<start_of_turn>`` turns, system text merged into the first user turn."""

from __future__ import annotations

import ftcore
from ftcore_plugins.templates._base import JinjaTemplate

# Gemma 3 instruction-tuned models' own chat template, verbatim (tokenizer_config.json of
# google/gemma-3-*-it, e.g. gemma-3-4b-it). Unlike Gemma 1/2 it takes a system message: its
# text and a blank line open the first user turn. Roles must alternate user/model (so there
# is no tool role), and contents are trimmed.
TEMPLATE = r'''{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
'''


class Gemma3Template(JinjaTemplate):
    """Gemma 3: <start_of_turn>user|model ... <end_of_turn>; a system message opens the first user turn."""

    name = "gemma3"
    template = TEMPLATE
    special_tokens = ("<start_of_turn>", "<end_of_turn>")
    stop_tokens = ("<end_of_turn>",)
    bos_token = "<bos>"


@ftcore.hookimpl
def register_chat_templates(register):
    register(Gemma3Template)
