"""Chat template ``chatml``: ``<|im_start|>role\\ncontent<|im_end|>\\n`` turns."""

from __future__ import annotations

import ftcore
from ftcore.component import Component

START, END = "<|im_start|>", "<|im_end|>"
JINJA = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ChatMLTemplate(Component):
    """ChatML turns (<|im_start|>role ... <|im_end|>), as used by Qwen and many others."""

    name = "chatml"
    stop_tokens = (END,)

    def render(self, messages, tokenizer=None, add_generation_prompt=False) -> str:
        text = "".join(f"{START}{m['role']}\n{m['content']}{END}\n" for m in messages)
        return text + (f"{START}assistant\n" if add_generation_prompt else "")

    def prepare(self, model, tokenizer):
        """Make the markers single special tokens, and ship the template with the tokenizer
        so exported models render prompts exactly as training did."""
        missing = [t for t in (START, END) if t not in tokenizer.get_vocab()]
        if missing:
            tokenizer.add_special_tokens({"additional_special_tokens": missing})
            model.resize_token_embeddings(len(tokenizer))
        tokenizer.chat_template = JINJA
        end_id = tokenizer.convert_tokens_to_ids(END)
        eos = model.generation_config.eos_token_id
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        if end_id not in eos:
            model.generation_config.eos_token_id = [*eos, end_id]
        if model.generation_config.pad_token_id is None:
            model.generation_config.pad_token_id = tokenizer.pad_token_id
        return model, tokenizer


@ftcore.hookimpl
def register_chat_templates(register):
    register(ChatMLTemplate)
