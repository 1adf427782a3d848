"""Chat template ``jinja``: a Jinja chat template read from a file."""

from __future__ import annotations

from pathlib import Path

import ftcore
from ftcore.errors import FtcoreError
from ftcore.types import InputPath
from ftcore_plugins.templates._base import JinjaTemplate, TemplateOptions, parse_jinja


class JinjaFileTemplate(JinjaTemplate):
    """A Jinja chat template from a file, rendered as a tokenizer's own chat template is."""

    name = "jinja"

    class Options(TemplateOptions):
        path: InputPath
        stop_tokens: list[str] = []
        special_tokens: list[str] = []

    def __init__(self, options=None):
        super().__init__(options)
        self._text: str | None = None
        # Instance attributes shadow the family class attributes the base reads.
        self.stop_tokens = tuple(self.options.stop_tokens)
        self.special_tokens = tuple(self.options.special_tokens)

    @property
    def title(self) -> str:
        """How messages name this template: by its file (relative to the working folder when inside it)."""
        path = Path(self.options.path)
        try:
            shown = path.resolve().relative_to(Path.cwd().resolve())
        except (ValueError, OSError):
            shown = path
        return f"template '{self.name}' ({shown})"

    @property
    def template(self) -> str:  # read, and checked, on first use
        if self._text is None:
            text, problem = self._read()
            if problem:
                raise FtcoreError(f"template 'jinja': {problem}")
            self._text = text
        return self._text

    def _read(self) -> tuple[str, str | None]:
        """The file's text, or a one-line problem naming the file."""
        path = Path(self.options.path)
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            return "", f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})"
        except OSError as exc:
            return "", f"{path}: cannot read: {exc.strerror}"
        try:
            parse_jinja(text, path)
        except FtcoreError as exc:
            return "", str(exc)
        return text, None

    def check(self, plan):
        _, problem = self._read()
        return [f"path: {problem}"] if problem else []


@ftcore.hookimpl
def register_chat_templates(register):
    register(JinjaFileTemplate)
