"""Chat template ``turns``: ``<|turn|>role\\ncontent<|end|>\\n``, with its own special tokens."""

from __future__ import annotations

import ftcore
from ftcore.component import Component
from ftcore_plugins.common.tokens import add_special_tokens

TURN, END = "<|turn|>", "<|end|>"
# The same text as render() writes, saved as the tokenizer's chat_template so exports render prompts alike.
JINJA = (
    "{% for message in messages %}{{ '<|turn|>' + message['role'] + '\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|turn|>assistant\\n' }}{% endif %}"
)


class TurnsTemplate(Component):
    """Turns marked <|turn|>role ... <|end|>, with its own special tokens; generation stops at <|end|>."""

    name = "turns"
    stop_tokens = (END,)  # evaluators stop generating at these (besides EOS)

    def render(self, messages, tokenizer=None, add_generation_prompt=False) -> str:
        text = "".join(f"{TURN}{m['role']}\n{m['content']}{END}\n" for m in messages)
        return text + (f"{TURN}assistant\n" if add_generation_prompt else "")

    def prepare(self, model, tokenizer):
        # Adds the tokens the tokenizer lacks, grows the embeddings (new rows drawn like the old ones, each
        # different), has LoRA train those rows, stops generation at <|end|> and saves JINJA
        # with the tokenizer.
        return add_special_tokens(model, tokenizer, [TURN, END], end_of_turn=END, chat_template=JINJA)


@ftcore.hookimpl
def register_chat_templates(register):
    register(TurnsTemplate)
