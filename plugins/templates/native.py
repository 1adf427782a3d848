"""Chat template ``native``: the tokenizer's own chat template."""

from __future__ import annotations

import ftcore
from ftcore.component import Component
from ftcore.errors import FtcoreError
from ftcore_plugins.templates._base import TemplateOptions, render_jinja, template_kwargs


class NativeTemplate(Component):
    """The tokenizer's own chat template (tokenizer_config.json's chat_template)."""

    name = "native"
    stop_tokens = ()  # read from the template's rendering (ftcore_plugins.common.spans)
    Options = TemplateOptions

    def render(self, messages, tokenizer=None, add_generation_prompt=False, tools=None) -> str:
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise FtcoreError("template 'native': the tokenizer has no chat template; "
                              "set [template] use = \"chatml\" (or another named template)")
        return render_jinja(self.name, None, list(messages), tokenizer, add_generation_prompt, tools,
                            template_kwargs(self))


@ftcore.hookimpl
def register_chat_templates(register):
    register(NativeTemplate)
