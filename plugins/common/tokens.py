"""Special tokens a chat template adds to a model, done once and done safely.

A template's markers (``<|im_start|>``, an end-of-turn token) must be single tokens the model
can learn. Adding them is four steps that are easy to get half right:

1. add the tokens the tokenizer lacks as special tokens;
2. grow the embeddings (and an untied output head) and draw each new row from the existing rows'
   per-dimension mean and spread: transformers' mean resizing gives every new row (almost
   exactly) the mean, so two added tokens, say an end-of-turn and a pad token, would be
   indistinguishable, and a row of near-zero size marks turns poorly (on the quickstart task a
   template whose markers started at the mean plus a tenth of the spread scored 0.70 exact
   match against chatml's 1.00; drawn with the whole spread, 0.88);
3. have the rows trained: under LoRA every embedding row is frozen, so a new end-of-turn token
   would keep its initial row and the model would never learn to stop. :func:`add_special_tokens`
   records the new ids on the model, and every peft adapter passes them to peft as
   ``trainable_token_indices`` (:func:`train_added_tokens`), which trains just those rows, ties an
   output head that shares the embedding, saves them with the adapter and merges them on export;
   a LoRA stage with ``train_template_tokens`` trains the rows of the template's tokens the
   tokenizer had already too (markers no data trained stay frozen otherwise);
4. make generation stop at the end-of-turn token (``eos_token_id`` of the model's config and
   generation config) and ship the chat template with the tokenizer, so exports render prompts
   as training did.

Templates call :func:`add_special_tokens` from their ``prepare(model, tokenizer)``.
"""

from __future__ import annotations

from typing import Any

from ftcore.errors import FtcoreError

ADDED_IDS = "ftcore_added_token_ids"  # attribute on the model: the ids add_special_tokens added
TEMPLATE_IDS = "ftcore_template_token_ids"  # attribute on the model: the template's tokens it had already
NOISE = 1.0  # new rows: the existing rows' mean plus this share of their per-dimension spread


def add_special_tokens(model: Any, tokenizer: Any, tokens: list[str] | tuple[str, ...], *,
                       end_of_turn: str | None = None, chat_template: str | None = None,
                       named: dict[str, str] | None = None) -> tuple[Any, Any]:
    """Add ``tokens`` (those the tokenizer lacks) as special tokens, grow and initialise the
    embeddings, mark the new rows for training under peft adapters, make generation stop at
    ``end_of_turn`` and set ``tokenizer.chat_template``. ``named`` adds named special tokens the
    tokenizer lacks, such as ``{"pad_token": "<pad>"}``. Returns ``(model, tokenizer)``.

    Safe to call again (a resumed run calls ``prepare`` on a freshly loaded model): tokens the
    tokenizer has are not added twice, and rows are re-initialised only when they were added now.
    """
    before = len(tokenizer)
    for key, token in (named or {}).items():
        if not getattr(tokenizer, key, None):
            tokenizer.add_special_tokens({key: token})
    vocab = tokenizer.get_vocab()
    had = {vocab[t] for t in tokens if t in vocab}
    if had:  # trained under LoRA on request (train_added_tokens' template_tokens)
        setattr(model, TEMPLATE_IDS, sorted({*template_token_ids(model), *had}))
    missing = [t for t in dict.fromkeys(tokens) if t not in vocab]
    if missing:
        tokenizer.add_special_tokens({"extra_special_tokens": missing}, replace_extra_special_tokens=False)
    new_ids = list(range(before, len(tokenizer)))
    if new_ids:
        rows = model.get_input_embeddings().weight.shape[0]
        if len(tokenizer) > rows:  # never shrink: some models carry spare rows
            model.resize_token_embeddings(len(tokenizer), mean_resizing=False)  # rows set below
            _spread_new_rows(model, rows, new_ids)
        # Trainable under LoRA: peft reads these when the adapter is applied (train_added_tokens).
        known = getattr(model, ADDED_IDS, None) or []
        setattr(model, ADDED_IDS, sorted({*known, *new_ids}))
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    if end_of_turn is not None:
        set_end_of_turn(model, tokenizer, end_of_turn)
    return model, tokenizer


def set_end_of_turn(model: Any, tokenizer: Any, token: str) -> None:
    """Generation stops at ``token``: it becomes the model config's ``eos_token_id`` and the first of
    the generation config's (the tokenizer's own EOS stays a stop token there too)."""
    if token not in tokenizer.get_vocab():
        raise FtcoreError(f"end-of-turn token {token!r} is not in the tokenizer; add it with add_special_tokens")
    end_id = tokenizer.convert_tokens_to_ids(token)
    config = getattr(model, "config", None)
    if config is not None:
        # A list keeps the tokenizer's EOS too: transformers' Trainer puts back a tokenizer EOS the
        # config lacks (align_special_tokens), which would drop the end-of-turn token.
        ids = list(dict.fromkeys([end_id, *([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])]))
        config.eos_token_id = ids[0] if len(ids) == 1 else ids
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        eos = generation.eos_token_id
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        if tokenizer.eos_token_id is not None:
            eos.append(tokenizer.eos_token_id)
        generation.eos_token_id = list(dict.fromkeys([end_id, *eos]))
        if generation.pad_token_id is None:
            generation.pad_token_id = tokenizer.pad_token_id


def added_token_ids(model: Any) -> list[int]:
    """The token ids :func:`add_special_tokens` added to ``model`` (through a peft wrapper too)."""
    try:
        return list(getattr(model, ADDED_IDS, None) or [])
    except AttributeError:
        return []


def template_token_ids(model: Any) -> list[int]:
    """The ids of the template's tokens that the tokenizer had before :func:`add_special_tokens` ran."""
    try:
        return list(getattr(model, TEMPLATE_IDS, None) or [])
    except AttributeError:
        return []


def train_added_tokens(config: Any, model: Any, adapter: str, template_tokens: bool = False) -> Any:
    """Have a peft ``config`` train the embedding rows of the tokens a template added (peft's
    ``trainable_token_indices``: only those rows train, and they are saved with the adapter).
    An adapter whose peft method cannot is an error saying what to use instead. With
    ``template_tokens``, also the rows of the template's tokens the tokenizer had already: a tokenizer
    can carry markers no training has touched (a scratch tokenizer's, a base model's chat tokens),
    and frozen under LoRA such an end-of-turn row is never learned (benchmarks/new_tokens.py)."""
    ids = added_token_ids(model)
    if template_tokens and hasattr(config, "trainable_token_indices"):
        ids = sorted({*ids, *template_token_ids(model)})
    if not ids:
        return config
    if not hasattr(config, "trainable_token_indices"):
        raise FtcoreError(f"adapter '{adapter}' cannot train the embeddings of the {len(ids)} special token(s) the "
                          "chat template added, so the model would never learn them (nor to stop at the end of a "
                          "turn); use adapter \"lora\" (or a LoRA variant) or \"full\", or a tokenizer that "
                          "already has the template's tokens")
    if config.trainable_token_indices:
        return config  # the plan chose its own
    inputs = model.get_input_embeddings()
    targets = {_module_name(model, inputs): ids}
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if output is not None and output.weight is not inputs.weight:
        targets[_module_name(model, output)] = ids  # an untied head: its new rows must learn too
    saved = set(getattr(config, "modules_to_save", None) or [])
    targets = {name: v for name, v in targets.items() if name not in saved}  # trained whole already
    if targets:
        config.trainable_token_indices = targets
    return config


def expose_head_bias(model: Any) -> Any:
    """After peft wrapped a model for :func:`train_added_tokens`: give each wrapped output head the
    ``bias`` of the layer it wraps. peft's wrapper answers ``weight`` (the base rows with the trained
    new rows in place) but not ``bias``, and TRL's fused LM head reads both."""
    from peft.utils.other import TrainableTokensWrapper

    for module in model.modules():
        if isinstance(module, TrainableTokensWrapper) and "bias" not in module.__dict__:
            base = module.token_adapter.base_layer
            # Not registered as a parameter of the wrapper: it stays the base layer's, saved and frozen as before.
            object.__setattr__(module, "bias", getattr(base, "bias", None))
    return model


def _module_name(model: Any, module: Any) -> str:
    """The module's last path component, as peft matches ``trainable_token_indices`` keys."""
    name = next(n for n, m in model.named_modules() if m is module)
    return name.rsplit(".", 1)[-1]


def _spread_new_rows(model: Any, old_rows: int, new_ids: list[int]) -> None:
    """Draw each new row around the existing rows' mean with their per-dimension spread, seeded by
    the token id: a row like the others in size, different from every other row."""
    import torch

    for layer in {id(m): m for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None}.values():
        weight = layer.weight
        if weight.shape[0] <= max(new_ids):
            continue
        with torch.no_grad():
            old = weight[:old_rows].float()
            mean, spread = old.mean(0), old.std(0)
            for i in new_ids:
                g = torch.Generator().manual_seed(i)
                noise = torch.randn(weight.shape[1], generator=g)
                weight[i] = (mean + NOISE * spread * noise.to(spread.device)).to(weight.dtype)
