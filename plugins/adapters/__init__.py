"""Adapter methods: what is trained (LoRA and its variants, IA3, prompt/prefix tuning, full and partial fine-tuning)."""
