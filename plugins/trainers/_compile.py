"""``compile = true``: torch.compile the model's repeated blocks (its decoder layers) for a stage.

Regional compilation: one block's graph is compiled once and serves every layer (their code and
shapes are the same), so compile time is that of one block, not of the whole model. The loss, the
head and the trainer's patches stay eager. The blocks are compiled for training only and are eager
again afterwards, for evaluation, generation and the next stage.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def repeated_blocks(model: Any) -> list[Any]:
    """The model's transformer blocks: the modules of the classes it names as never to be split
    across devices (``_no_split_modules``: its decoder layers), found through a peft wrapper."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    return [m for m in base.modules() if type(m).__name__ in names]


def compile_problem() -> str | None:
    """Why ``compile = true`` can't run here, or None."""
    import shutil

    if shutil.which("cc") is None and shutil.which("gcc") is None:
        return "compile = true needs a C compiler for torch.compile's CPU code (cc or gcc), and none is on PATH"
    return None


@contextlib.contextmanager
def compiled_blocks(model: Any, enabled: bool) -> Iterator[int]:
    """Compile ``model``'s blocks while the block runs (yields how many; 0 when not ``enabled``)."""
    blocks = repeated_blocks(model) if enabled else []
    if enabled and not blocks:
        from ftcore.errors import FtcoreError

        raise FtcoreError(f"compile = true: {type(model).__name__} names no repeated blocks to compile "
                          "(its _no_split_modules); set compile = false")
    for block in blocks:
        block.compile()
    try:
        yield len(blocks)
    finally:
        for block in blocks:
            block._compiled_call_impl = None  # nn.Module.compile's own slot: eager calls again
