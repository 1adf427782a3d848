"""ftcore: a plugin-based toolkit for fine-tuning language models.

Plugin authors need only this module::

    import ftcore

    @ftcore.hookimpl
    def register_evaluators(register):
        register(MyEvaluator)

Importing ftcore is cheap on purpose: nothing here imports torch, transformers or
pydantic, so ``ftcore --help`` stays fast.
"""

from __future__ import annotations

import pluggy

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("ftcore")

__all__ = ["hookimpl", "__version__", "Component", "FtcoreError", "InputPath", "OutputPath"]


def __getattr__(name: str):
    # Lazy re-exports keep `import ftcore` light for the CLI's fast paths.
    if name == "Component":
        from .component import Component

        return Component
    if name in ("InputPath", "OutputPath"):
        from . import types

        return getattr(types, name)
    if name == "FtcoreError":
        from .errors import FtcoreError

        return FtcoreError
    raise AttributeError(f"module 'ftcore' has no attribute {name!r}")
