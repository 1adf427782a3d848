"""Chat template ``phi3``: Phi-3/3.5's ``<|role|>`` turns closed by ``<|end|>``."""

from __future__ import annotations

import ftcore
from ftcore_plugins.templates._base import JinjaTemplate

# Phi-3.5-mini-instruct's chat template (also the current one of Phi-3-mini/medium),
# except for its last clause, "{% else %}{{ eos_token }}": it appends <|endoftext|> to a
# conversation rendered without a generation prompt, so a conversation's text would not
# start with its earlier turns' text, which the loss mask relies on. <|end|> closes every
# turn and is the stop token, so the model still learns to stop. An empty system
# message renders nothing.
TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}"
    "{{'<|system|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}"
    "{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


class Phi3Template(JinjaTemplate):
    """Phi-3 / Phi-3.5: <|system|>, <|user|>, <|assistant|> turns closed by <|end|>."""

    name = "phi3"
    template = TEMPLATE
    special_tokens = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
    stop_tokens = ("<|end|>",)


@ftcore.hookimpl
def register_chat_templates(register):
    register(Phi3Template)
