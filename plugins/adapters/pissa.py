"""Adapter ``pissa``: LoRA initialised from the principal singular vectors of each weight (peft)."""

from __future__ import annotations

import ftcore

from ftcore_plugins.adapters.lora import LoraAdapter


class PissaAdapter(LoraAdapter):
    """PiSSA (peft): the adapter starts as the top-r singular components of each targeted weight, which
    are removed from the frozen base weight (a residual); training then moves the principal part."""

    name = "pissa"
    full_precision_base = True  # peft computes the SVD on float weights and rewrites them

    def lora_kwargs(self):
        # Full SVD, not peft's randomised "pissa_niter_N": restoring the adapter recomputes the
        # residual from the base weights, and only the full SVD gives the same residual again.
        return {**super().lora_kwargs(), "init_lora_weights": "pissa"}


@ftcore.hookimpl
def register_adapters(register):
    register(PissaAdapter)
