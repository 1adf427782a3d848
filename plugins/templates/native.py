"""Chat template ``native``: the tokenizer's own chat template."""

from __future__ import annotations

import ftcore
from ftcore.component import Component
from ftcore.errors import FtcoreError


class NativeTemplate(Component):
    """The tokenizer's own chat template (tokenizer_config.json's chat_template)."""

    name = "native"
    stop_tokens = ()

    def render(self, messages, tokenizer=None, add_generation_prompt=False) -> str:
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise FtcoreError("template 'native': the tokenizer has no chat template; "
                              "set [template] use = \"chatml\" (or another named template)")
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # jinja raises for roles a family rejects (e.g. Gemma's system)
            raise FtcoreError(f"template 'native': the tokenizer's chat template failed: {exc}") from exc


@ftcore.hookimpl
def register_chat_templates(register):
    register(NativeTemplate)
