"""The ``optimizer`` option: transformers' optimizer names, what each needs, and the one-line
refusal of one that cannot run here (checked by ``ftcore validate`` without importing torch).

The names are transformers' ``OptimizerNames`` (``tests/test_optimizers.py`` checks that every one
here is still there); ``lion`` is ours, for bitsandbytes' 32-bit Lion."""

from __future__ import annotations

import importlib.util

from ftcore.errors import unknown_choice
from ftcore_plugins.common.device_defaults import optimizer_for

ALIASES = {"lion": "lion_32bit"}

_BNB = ("bitsandbytes", "bitsandbytes")
# name -> (module to import, pip package) or None for torch/transformers alone
OPTIMIZERS: dict[str, tuple[str, str] | None] = {
    "adamw_torch": None, "adamw_torch_fused": None, "adafactor": None, "sgd": None, "adagrad": None,
    "rmsprop": None,
    "adamw_8bit": _BNB, "adamw_bnb_8bit": _BNB, "paged_adamw_8bit": _BNB, "paged_adamw_32bit": _BNB,
    "lion_8bit": _BNB, "lion_32bit": _BNB, "paged_lion_8bit": _BNB, "paged_lion_32bit": _BNB,
    "ademamix": _BNB, "ademamix_8bit": _BNB, "paged_ademamix_32bit": _BNB, "paged_ademamix_8bit": _BNB,
    "rmsprop_bnb": _BNB, "rmsprop_bnb_8bit": _BNB, "rmsprop_bnb_32bit": _BNB,
    "galore_adamw": ("galore_torch", "galore-torch"), "galore_adamw_8bit": ("galore_torch", "galore-torch"),
    "galore_adafactor": ("galore_torch", "galore-torch"),
    "apollo_adamw": ("apollo_torch", "apollo-torch"),
    "lomo": ("lomo_optim", "lomo-optim"), "adalomo": ("lomo_optim", "lomo-optim"),
    "grokadamw": ("grokadamw", "grokadamw"),
    "schedule_free_adamw": ("schedulefree", "schedulefree"), "schedule_free_radam": ("schedulefree", "schedulefree"),
    "schedule_free_sgd": ("schedulefree", "schedulefree"),
    "adamw_torch_4bit": ("torchao", "torchao"), "adamw_torch_8bit": ("torchao", "torchao"),
    "stable_adamw": ("optimi", "torch-optimi"),
}
# GaLore projects the gradients of whole weight matrices: full fine-tuning only.
GALORE_TARGETS = [r".*attn.*", r".*mlp.*"]


def optimizer_name(name: str) -> str:
    """transformers' name for ``name`` (an alias resolved; ``auto`` kept, see ``device_defaults.optimizer_for``); raises
    ValueError for an unknown one."""
    name = ALIASES.get(name, name)
    if name != "auto" and name not in OPTIMIZERS:
        raise ValueError(unknown_choice("optimizer", name, ["auto", *OPTIMIZERS, *ALIASES]))
    return name


def optimizer_problem(name: str, *, adapter: str | None) -> str | None:
    """Why ``optimizer = name`` cannot run here (a missing package, GaLore on an adapter)."""
    name = optimizer_for(name)
    needs = OPTIMIZERS[name]
    if needs is not None and importlib.util.find_spec(needs[0]) is None:
        return f"optimizer: {name} needs the {needs[1]} package, which is not installed (pip install {needs[1]})"
    if name.startswith("galore_") and adapter not in (None, "full", "freeze"):
        return (f"optimizer: {name} projects the gradients of whole weight matrices, so it trains full weights; "
                f"this stage's adapter is {adapter!r}: use adapter = \"full\", or another optimizer")
    return None


def optimizer_arguments(name: str, device: str | None = None) -> dict:
    """TrainingArguments for ``optimizer = name`` on ``device`` (this machine's when None)."""
    name = optimizer_for(name, device)
    args: dict = {"optim": name}
    if name.startswith("galore_"):
        args["optim_target_modules"] = GALORE_TARGETS
    return args
