"""Chat template ``deepseek-r1``: DeepSeek-R1's ``<｜User｜>``/``<｜Assistant｜>`` format (the R1 distills)."""

from __future__ import annotations

import ftcore
from ftcore_plugins.templates._base import JinjaTemplate

# DeepSeek-R1-Distill-Qwen-32B's own chat template, verbatim (tokenizer_config.json of
# deepseek-ai/DeepSeek-R1-Distill-Qwen-32B; the other R1 distills ship the same text). The
# system text comes first, with no marker; "</think>" and what precedes it are cut from
# assistant contents, and the generation prompt opens a think block ("<｜Assistant｜><think>\n"),
# so history is not rendered prefix by prefix. As shipped, tool calls render only for an
# assistant message whose content is None, take their arguments as a JSON string, and the
# closing <｜tool▁calls▁end｜> is written only after a second call. llama.cpp's copy
# (models/templates/deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja) is an edited version of
# this text (tool calls fixed, an enable_thinking switch); this is the model's own.
TEMPLATE = r'''{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='') %}{%- for message in messages %}{%- if message['role'] == 'system' %}{% set ns.system_prompt = message['content'] %}{%- endif %}{%- endfor %}{{bos_token}}{{ns.system_prompt}}{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}{%- endif %}{%- if message['role'] == 'assistant' and message['content'] is none %}{%- set ns.is_tool = false -%}{%- for tool in message['tool_calls']%}{%- if not ns.is_first %}{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}{%- set ns.is_first = true -%}{%- else %}{{'\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}{%- endfor %}{%- endif %}{%- if message['role'] == 'assistant' and message['content'] is not none %}{%- if ns.is_tool %}{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}{%- else %}{% set content = message['content'] %}{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}{%- if ns.is_output_first %}{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- set ns.is_output_first = false %}{%- else %}{{'\n<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- endif %}{%- endif %}{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜><think>\n'}}{% endif %}'''


class DeepSeekR1Template(JinjaTemplate):
    """DeepSeek-R1 (distills): <｜User｜>...<｜Assistant｜>...<｜end▁of▁sentence｜>, think blocks cut from history."""

    name = "deepseek-r1"
    template = TEMPLATE
    special_tokens = ("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "<｜tool▁calls▁begin｜>",
                      "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
                      "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                      "<｜tool▁output▁end｜>")
    # The template writes <｜end▁of▁sentence｜> itself (not eos_token), so it is the end of turn
    # whatever the tokenizer's EOS is.
    stop_tokens = ("<｜end▁of▁sentence｜>",)
    bos_token = "<｜begin▁of▁sentence｜>"


@ftcore.hookimpl
def register_chat_templates(register):
    register(DeepSeekR1Template)
