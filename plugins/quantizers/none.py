"""Quantizer ``none``: load weights as they are."""

from __future__ import annotations

import ftcore
from ftcore.component import Component


class NoQuantizer(Component):
    """No quantization: weights load in the model loader's dtype."""

    name = "none"

    def load_kwargs(self) -> dict:
        return {}

    def prepare(self, model):
        return model


@ftcore.hookimpl
def register_quantizers(register):
    register(NoQuantizer)
