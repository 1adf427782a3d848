"""Batched generation, as the ``generation`` evaluator and ``ftcore generate`` both do it: left
padding, no special tokens added to the rendered prompts, stop at the given token ids, answers
decoded without special tokens and stripped."""

from __future__ import annotations

from typing import Any


def batched_answers(model: Any, tokenizer: Any, prompts: list[str], *, batch_size: int, progress: Any,
                    seed: int | None = None, encode: Any = None, **generate_kwargs: Any) -> list[str]:
    """The model's answers to rendered ``prompts``; ``progress.advance(n)`` after each batch;
    ``generate_kwargs`` (stop ids, sampling, ``max_new_tokens``) go to ``model.generate``. ``encode(start,
    texts)``, when given, makes a batch's left-padded inputs (a vision-language model's processor). An
    encoder-decoder reads each prompt as it did in training (right-padded, the tokenizer's special tokens:
    ``common/seq2seq.py``), and everything its decoder writes is the answer."""
    import torch

    from ftcore_plugins.common.seq2seq import encoder_batch, is_encoder_decoder

    seq2seq = is_encoder_decoder(model)
    device = next(model.parameters()).device
    side, tokenizer.padding_side = tokenizer.padding_side, "left"  # decoder-only models generate from the right
    was_training = model.training
    model.eval()
    answers: list[str] = []
    try:
        if seed is not None:
            torch.manual_seed(seed)
        with torch.no_grad():
            for start in range(0, len(prompts), batch_size):
                texts = prompts[start:start + batch_size]
                if seq2seq:
                    batch = encoder_batch(tokenizer, texts).to(device)
                else:
                    batch = encode(start, texts) if encode is not None else \
                        tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
                out = model.generate(**batch, **generate_kwargs)
                new = out if seq2seq else out[:, batch["input_ids"].shape[1]:]  # a decoder-only model echoes the prompt
                answers += [a.strip() for a in tokenizer.batch_decode(new, skip_special_tokens=True)]
                progress.advance(len(new))
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return answers
