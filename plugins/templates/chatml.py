"""Chat template ``chatml``: ``<|im_start|>role\\ncontent<|im_end|>\\n`` turns."""

from __future__ import annotations

import ftcore
from ftcore_plugins.templates._base import JinjaTemplate, template_kwargs

START, END = "<|im_start|>", "<|im_end|>"
JINJA = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ChatMLTemplate(JinjaTemplate):
    """ChatML turns (<|im_start|>role ... <|im_end|>), as used by Qwen and many others."""

    name = "chatml"
    template = JINJA
    special_tokens = (START, END)
    stop_tokens = (END,)

    def render(self, messages, tokenizer=None, add_generation_prompt=False, tools=None) -> str:
        if tools or template_kwargs(self):
            return super().render(messages, tokenizer, add_generation_prompt, tools)
        # The same text as JINJA renders, without a Jinja round trip (tests check they agree).
        text = "".join(f"{START}{m['role']}\n{m['content']}{END}\n" for m in messages)
        return text + (f"{START}assistant\n" if add_generation_prompt else "")


@ftcore.hookimpl
def register_chat_templates(register):
    register(ChatMLTemplate)
