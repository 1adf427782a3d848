"""Third-party chatter kept off the console of ``ftcore run`` (through the ``ftcore_cli_start`` hook) and of
the commands that load models (``check``, ``lr-find``, ``prepare``, ``sweep`` call :func:`quiet_libraries`)."""

from __future__ import annotations

import logging
import os
import sys

import ftcore


def quiet_libraries(verbose: bool = False) -> None:
    """Keep third-party chatter off the console for the rest of this process: the progress bars of
    transformers ("Loading weights"), datasets and the hub, transformers' and datasets' advisory messages
    (datasets' "couldn't be hashed properly", which its own handler prints), and Python warnings (a
    library's ``FutureWarning``). Warnings go to the logging system instead, so ``run.log`` keeps them, as
    it keeps the libraries' log records; ``verbose`` (``--debug``) leaves everything as the libraries set it.
    Call it before they are imported: they read these settings then."""
    if verbose:
        return
    for name, value in (("HF_HUB_DISABLE_PROGRESS_BARS", "1"), ("HF_DATASETS_DISABLE_PROGRESS_BARS", "1"),
                        ("TRANSFORMERS_VERBOSITY", "error"), ("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1"),
                        ("DATASETS_VERBOSITY", "error")):
        os.environ.setdefault(name, value)
    level = logging.getLevelName(os.environ["DATASETS_VERBOSITY"].upper())
    if "datasets" in sys.modules and isinstance(level, int):  # imported already (a process that preloaded it)
        logging.getLogger("datasets").setLevel(level)
    from ftcore_plugins.common.memory import gpu_visible

    if not gpu_visible():
        # What DeepSpeed picks anyway on such a machine; said up front, it does not print (to stdout, through
        # its own handler) that it "was unable to detect" a GPU when transformers imports it.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    logging.captureWarnings(True)
    # Not Python's last-resort handler, which prints a library's log warnings (bitsandbytes' "Failed to
    # load CPU gemm_4bit_forward ...") to stderr: until run.log exists they are dropped.
    root = logging.getLogger()
    if not any(isinstance(h, logging.NullHandler) for h in root.handlers):
        root.addHandler(logging.NullHandler())


@ftcore.hookimpl
def ftcore_cli_start(command: str, debug: bool) -> None:
    """``ftcore run``: quiet the libraries before a plugin imports them (``--debug`` leaves them as they are)."""
    if command == "run":
        quiet_libraries(verbose=debug)
