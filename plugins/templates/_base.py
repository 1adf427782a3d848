"""Shared base for chat template families defined by a Jinja chat template.

A family is one Jinja string (the single source of truth: the same text renders
training data, is saved as the exported tokenizer's ``chat_template``, and is what a
tokenizer's own ``apply_chat_template`` would render), the special tokens that string
writes, and the end-of-turn tokens generation stops at. Rendering goes through
``transformers``' ``apply_chat_template``, so ``bos_token`` and ``eos_token`` in the
template are the tokenizer's own.

Assistant turns are found in the rendering of the whole conversation
(:mod:`ftcore_plugins.common.spans`), so a family may render history differently from the
turn being generated, as Qwen3 and gpt-oss do.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from ftcore.component import Component, Options
from ftcore.errors import FtcoreError

from ftcore_plugins.common.spans import template_title
from ftcore_plugins.common.tokens import add_special_tokens, set_end_of_turn

# Jinja run before a family's own template when ``system = "merge"``: a first system
# message is joined to the first user message with a blank line, as Gemma 3's and
# Mistral's later templates do. Saved with the exported tokenizer, so it renders the same.
MERGE_SYSTEM = (
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- if messages | length > 1 and messages[1]['role'] == 'user' -%}"
    "{%- set messages = [{'role': 'user', 'content': messages[0]['content'] + '\\n\\n' + messages[1]['content']}]"
    " + messages[2:] -%}"
    "{%- else -%}"
    "{{- raise_exception('a system message can only be merged into a user message right after it') -}}"
    "{%- endif -%}"
    "{%- endif %}"
)
MERGE_JOIN = "\n\n"


class TemplateOptions(Options):
    """Options every built-in template takes."""

    samples: Literal["conversation", "per_turn"] = "conversation"
    """``conversation``: one sample per row, the conversation as the template renders it (a
    thinking template drops earlier turns' reasoning), every assistant turn trained.
    ``per_turn``: one sample per assistant turn, the conversation up to and including it, only
    that turn trained: each turn's reasoning is trained in the context the model generates it in."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra variables for the Jinja template, as ``apply_chat_template(**kwargs)`` passes them,
    e.g. ``{ enable_thinking = false }`` for Qwen3's no-think mode."""
    dropped_reasoning: Literal["error", "warn"] = "error"
    """An assistant turn's ``reasoning_content`` that the template does not render (not even for
    the turn being generated): ``error`` refuses the row, as a dropped tool call is refused;
    ``warn`` trains the answer without it and warns once with the count."""


class NoSystemOptions(TemplateOptions):
    """Options of a family whose format has no system role."""

    system: Literal["error", "merge"] = "error"
    """``error``: a system message is an error. ``merge``: a first system message is
    prepended to the first user message, joined by a blank line (``"\\n\\n"``)."""


class JinjaTemplate(Component):
    """A chat template family defined by one Jinja chat template.

    Subclasses set ``name``, ``template`` and, as needed, the class attributes below.
    """

    template: ClassVar[str] = ""
    """The Jinja chat template, rendered by transformers with ``trim_blocks`` and
    ``lstrip_blocks``, as a tokenizer's own chat template is."""
    special_tokens: ClassVar[tuple[str, ...]] = ()
    """Tokens the template writes that must be single special tokens; ``prepare`` adds
    the ones a tokenizer lacks."""
    stop_tokens: ClassVar[tuple[str, ...]] = ()
    """End-of-turn tokens besides EOS; the first closes every assistant turn. Empty when
    turns end with ``eos_token``."""
    bos_token: ClassVar[str | None] = None
    eos_token: ClassVar[str | None] = None
    """What ``bos_token``/``eos_token`` render as when the tokenizer has none (or no
    tokenizer is given); ``prepare`` then sets them on the tokenizer. ``None``: the
    template does not need one."""
    system_role: ClassVar[bool] = True
    """False for formats without a system role; such families take ``NoSystemOptions``."""
    Options = TemplateOptions

    # -- the template actually used ------------------------------------------------

    def chat_template(self) -> str:
        """The Jinja text this component renders with and saves with the tokenizer."""
        if not self.system_role and getattr(self.options, "system", "error") == "merge":
            return MERGE_SYSTEM + self.template
        return self.template

    def end_of_turn(self, tokenizer: Any = None) -> str | None:
        """The token that closes an assistant turn."""
        if self.stop_tokens:
            return self.stop_tokens[0]
        return _token(tokenizer, "eos_token") or self.eos_token

    # -- rendering ------------------------------------------------------------------

    def render(self, messages: list[dict], tokenizer: Any = None, add_generation_prompt: bool = False,
               tools: list[dict] | None = None) -> str:
        messages = list(messages)
        if not self.system_role:
            self._check_system(messages)
        defaults = {k: v for k, v in (("bos_token", self.bos_token), ("eos_token", self.eos_token))
                    if v is not None and _token(tokenizer, k) is None}
        return render_jinja(template_title(self), self.chat_template(), messages, tokenizer, add_generation_prompt,
                            tools, {**template_kwargs(self), **defaults})

    def _check_system(self, messages: list[dict]) -> None:
        for i, message in enumerate(messages):
            if message.get("role") != "system":
                continue
            if i > 0:
                raise FtcoreError(f"{template_title(self)} has no system role, and message {i} is a system message "
                                  "after the start of the conversation; only a first system message can be merged "
                                  "into the first user turn")
            if getattr(self.options, "system", "error") != "merge":
                raise FtcoreError(f"{template_title(self)} has no system role, and this conversation starts with a "
                                  'system message; set system = "merge" in [template] to prepend it to the first '
                                  "user turn")

    # -- preparing model and tokenizer -------------------------------------------------

    def required_tokens(self) -> list[str]:
        """Special tokens the rendered text relies on (besides bos/eos)."""
        return list(dict.fromkeys([*self.special_tokens, *self.stop_tokens]))

    def prepare(self, model: Any, tokenizer: Any) -> tuple[Any, Any]:
        """Make the template's markers single special tokens (growing the embeddings only
        when a token was added, and training the new rows under LoRA), ship the template with
        the tokenizer so exported models render prompts exactly as training did, and stop
        generation at end of turn. All through :func:`ftcore_plugins.common.tokens.add_special_tokens`."""
        template = self.chat_template()
        named = {key: default for key, default in (("bos_token", self.bos_token), ("eos_token", self.eos_token))
                 if default is not None and key in template and _token(tokenizer, key) is None}
        # The end of turn is known once bos/eos exist: a template whose turns end with EOS uses the tokenizer's.
        model, tokenizer = add_special_tokens(model, tokenizer, self.required_tokens(), named=named,
                                              chat_template=template)
        end = self.end_of_turn(tokenizer)
        if end is not None:
            set_end_of_turn(model, tokenizer, end)
        return model, tokenizer


def template_kwargs(template: Any) -> dict[str, Any]:
    """The plan's ``chat_template_kwargs`` for a template (none for a template without the option)."""
    return dict(getattr(getattr(template, "options", None), "chat_template_kwargs", None) or {})


def render_jinja(name: str, template: str | None, messages: list[dict], tokenizer: Any,
                 add_generation_prompt: bool, tools: list[dict] | None, variables: dict[str, Any]) -> str:
    """Render ``messages`` with a Jinja chat template as transformers does (``template`` None: the
    tokenizer's own), ``tools`` passed as ``apply_chat_template(tools=...)`` passes them. ``name``:
    the template's name, or how messages name it (:func:`template_title`)."""
    import jinja2  # transformers renders chat templates with it

    title = name if name.startswith("template ") else f"template '{name}'"

    source = template if template is not None else getattr(tokenizer, "chat_template", None)
    if tools and isinstance(source, str) and "tools" not in source:
        raise FtcoreError(f"{title} does not render tool schemas, and this conversation has 'tools'; "
                          "use a template that does (e.g. \"native\" with a tool-calling model's tokenizer)")
    try:
        if tokenizer is not None and messages:
            return tokenizer.apply_chat_template(messages, chat_template=template, tools=tools, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt, **variables)
        # No tokenizer, or nothing to render yet (apply_chat_template refuses an empty
        # conversation): the same renderer, fed the same variables.
        from transformers.utils.chat_template_utils import render_jinja_template

        variables = {**(dict(tokenizer.special_tokens_map) if tokenizer is not None else {}), **variables}
        rendered, _ = render_jinja_template(conversations=[messages], chat_template=source, tools=tools,
                                            add_generation_prompt=add_generation_prompt, **variables)
        return rendered[0]
    except (jinja2.TemplateError, ValueError, TypeError, KeyError, AttributeError, IndexError) as exc:
        # raise_exception in the template, undefined values, a template that needs what the row lacks
        raise FtcoreError(f"{title} cannot render this conversation: {_one_line(exc)}") from exc


def _token(tokenizer: Any, key: str) -> str | None:
    value = getattr(tokenizer, key, None) if tokenizer is not None else None
    return str(value) if value else None


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


# -- Jinja files ---------------------------------------------------------------------


def parse_jinja(text: str, path: Any) -> None:
    """Raise a one-line :class:`FtcoreError` naming ``path`` if ``text`` is not a valid
    chat template (Jinja as transformers renders it). Needs only jinja2."""
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    class Generation(jinja2.ext.Extension):  # transformers' {% generation %} block
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[Generation, jinja2.ext.loopcontrols])
    try:
        env.parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise FtcoreError(f"{path}:{exc.lineno}: not a valid Jinja chat template: {_one_line(exc)}") from None
