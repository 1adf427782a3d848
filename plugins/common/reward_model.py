"""A reward model an earlier ``reward`` stage saved, as the online trainers (``ppo``, ``grpo``,
``rloo``) load and run it: one sequence-classification logit per text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ftcore.errors import FtcoreError


def load(folder: Path, device: Any, stage: str, ref: str) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from ``folder`` (the output of stage ``ref``), frozen, on ``device``."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise FtcoreError(f"stage {stage}: reward_model = {ref!r}: {folder} holds no saved model (no config.json); "
                          f"stage {ref!r} must save a sequence-classification model (trainer 'reward'): "
                          "did it finish? Run the plan again with --resume")
    labels = getattr(AutoConfig.from_pretrained(folder), "num_labels", 1)
    if labels != 1:
        raise FtcoreError(f"stage {stage}: reward_model = {ref!r} has {labels} outputs; a reward model gives "
                          "one score (num_labels = 1)")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).to(device).eval()
    model.requires_grad_(False)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id  # it scores each row's last non-pad token
    return model, tokenizer


def scores(model: Any, tokenizer: Any, texts: list[str], device: Any, batch_size: int | None = None) -> list[float]:
    """The model's score of each text, as written (no special tokens added), ``batch_size`` at a time."""
    import torch

    out: list[float] = []
    step = batch_size or max(len(texts), 1)
    with torch.inference_mode():
        for start in range(0, len(texts), step):
            batch = tokenizer(texts[start:start + step], return_tensors="pt", padding=True, padding_side="right",
                              add_special_tokens=False).to(device)
            out += model(**batch).logits[:, 0].float().tolist()
    return out
