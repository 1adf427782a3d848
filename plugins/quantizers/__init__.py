"""Quantizers: how the base model's weights are loaded (full precision, or bitsandbytes 4-bit and 8-bit)."""
