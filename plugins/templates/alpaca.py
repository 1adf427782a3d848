"""Chat template ``alpaca``: Stanford Alpaca's ``### Instruction:``/``### Response:`` blocks."""

from __future__ import annotations

import ftcore
from ftcore_plugins.templates._base import JinjaTemplate

DEFAULT_SYSTEM = ("Below is an instruction that describes a task. "
                  "Write a response that appropriately completes the request.")

# Stanford Alpaca's prompt (no-input form; an Alpaca row's input is already part of the
# user turn), extended to several turns as LLaMA-Factory and alpaca-lora do:
# "{system}\n\n### Instruction:\n{user}\n\n### Response:\n{answer}</s>", further turns
# separated by a blank line. Without a system message, Alpaca's preamble is used. The
# tokenizer's BOS, if it has one, starts the text (as Alpaca's training added it).
TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system_message = messages[0]['content'] -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set system_message = '" + DEFAULT_SYSTEM + "' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- if bos_token -%}{{- bos_token -}}{%- endif -%}"
    "{{- system_message + '\\n\\n' -}}"
    "{%- for message in loop_messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "{%- if not loop.first -%}{{- '\\n\\n' -}}{%- endif -%}"
    "{{- '### Instruction:\\n' + message['content'] + '\\n\\n' -}}"
    "{%- elif message['role'] == 'assistant' -%}{{- '### Response:\\n' + message['content'] + eos_token -}}"
    "{%- else -%}{{- raise_exception('alpaca supports a first system message, then user and assistant "
    "messages only') -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '### Response:\\n' -}}{%- endif -%}"
)


class AlpacaTemplate(JinjaTemplate):
    """Stanford Alpaca: a preamble, then ### Instruction / ### Response blocks, answers closed by EOS."""

    name = "alpaca"
    template = TEMPLATE
    eos_token = "</s>"


@ftcore.hookimpl
def register_chat_templates(register):
    register(AlpacaTemplate)
