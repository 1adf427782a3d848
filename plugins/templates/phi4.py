"""Chat template ``phi4``: Phi-4's ``<|im_start|>role<|im_sep|>`` turns."""

from __future__ import annotations

import ftcore
from ftcore_plugins.templates._base import JinjaTemplate

# Phi-4's own chat template, verbatim (tokenizer_config.json of microsoft/phi-4, the text in
# use since its January 2025 revision, which added the generation prompt). Turns follow each
# other with no newline between them; other roles than system, user and assistant render
# nothing.
TEMPLATE = (
    "{% for message in messages %}{% if (message['role'] == 'system') %}{{'<|im_start|>system<|im_sep|>' + "
    "message['content'] + '<|im_end|>'}}{% elif (message['role'] == 'user') %}{{'<|im_start|>user<|im_sep|>' + "
    "message['content'] + '<|im_end|>'}}{% elif (message['role'] == 'assistant') %}"
    "{{'<|im_start|>assistant<|im_sep|>' + message['content'] + '<|im_end|>'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant<|im_sep|>' }}{% endif %}"
)


class Phi4Template(JinjaTemplate):
    """Phi-4: <|im_start|>role<|im_sep|>content<|im_end|>, no newlines between turns."""

    name = "phi4"
    template = TEMPLATE
    special_tokens = ("<|im_start|>", "<|im_sep|>", "<|im_end|>")
    stop_tokens = ("<|im_end|>",)


@ftcore.hookimpl
def register_chat_templates(register):
    register(Phi4Template)
