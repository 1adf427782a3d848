"""ftcore: a plugin-based toolkit for fine-tuning language models. Plugin authors need only this module,
for ``@ftcore.hookimpl`` (docs/writing-plugins.md). Importing it is cheap on purpose: nothing here imports
torch, transformers or pydantic, so ``ftcore --help`` stays fast."""

from __future__ import annotations

import importlib

import pluggy

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("ftcore")

__all__ = ["hookimpl", "__version__", "Component", "FtcoreError", "InputPath", "OutputPath"]


_LAZY = {"Component": "component", "InputPath": "types", "OutputPath": "types", "FtcoreError": "errors"}


def __getattr__(name: str):
    # Lazy re-exports keep `import ftcore` light for the CLI's fast paths.
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'ftcore' has no attribute {name!r}")
