"""Model loader ``scratch``: a small randomly initialised model and a tokenizer trained
locally on the plan's own data. No downloads: this is how pre-training from scratch and
the offline quickstart work."""

from __future__ import annotations

from typing import Any

from pydantic import Field

import ftcore
from ftcore.component import Component, Options
from ftcore.types import InputPath

from ftcore_plugins.models._attention import Attention, attention_problem

EOS, PAD = "<|endoftext|>", "<|pad|>"


class ScratchModelLoader(Component):
    """A randomly initialised model from an architecture config, with a locally trained BPE tokenizer."""

    name = "scratch"

    class Options(Options):
        architecture: str = "llama"  # a transformers model_type: llama, mistral, qwen2, qwen3, ...
        hidden_size: int = Field(64, ge=1, le=65536)
        num_layers: int = Field(2, ge=1, le=1024)
        num_heads: int = Field(4, ge=1, le=1024)
        num_kv_heads: int | None = Field(None, ge=1, le=1024)
        intermediate_size: int | None = Field(None, ge=1, le=1 << 20)  # defaults to 4 x hidden_size
        max_position_embeddings: int = Field(512, ge=1, le=1 << 24)
        tie_word_embeddings: bool = True
        config: dict[str, Any] = {}  # any further config fields, passed as is
        tokenizer: InputPath | None = None  # use an existing tokenizer folder ...
        tokenizer_data: list[str] = []  # ... or train one on these [data.*] entries
        vocab_size: int = Field(2048, ge=1, le=1 << 22)
        special_tokens: list[str] = ["<|im_start|>", "<|im_end|>"]
        attn_implementation: Attention | None = None  # transformers' default (sdpa) when unset

    def check(self, plan) -> list[str]:
        o = self.options
        problems = []
        if (o.tokenizer is None) == (not o.tokenizer_data):
            problems.append("set exactly one of 'tokenizer' (a folder) or 'tokenizer_data' (data names to train on)")
        for i, name in enumerate(o.tokenizer_data):
            if name not in plan.data:
                problems.append(f"tokenizer_data[{i}]: undefined data {name!r}; defined: {', '.join(plan.data)}")
        attention = attention_problem(o.attn_implementation)
        return problems + ([attention] if attention else [])

    def load(self, ctx):
        import torch
        from transformers import AutoModelForCausalLM

        o = self.options
        tokenizer = self.load_tokenizer(ctx)
        config = self.model_config(len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                   eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        torch.manual_seed(ctx.seed)
        extra = {"attn_implementation": o.attn_implementation} if o.attn_implementation else {}
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **extra)
        n = sum(p.numel() for p in model.parameters())
        ctx.reporter.info(f"scratch model: {o.architecture}, {o.num_layers} layers, hidden {o.hidden_size}, "
                          f"{n:,} parameters, vocabulary {len(tokenizer):,}")
        return model, tokenizer

    def load_tokenizer(self, ctx):
        """The tokenizer alone: the plan's folder, or trained on ``tokenizer_data`` (saved in the
        loader's work folder, where a resumed run finds it again)."""
        from transformers import AutoTokenizer

        o = self.options
        if o.tokenizer is not None:
            tokenizer = AutoTokenizer.from_pretrained(o.tokenizer)
        else:
            saved = ctx.work_dir / "tokenizer"
            if (saved / "tokenizer.json").exists():  # resume: reuse the tokenizer this run trained
                tokenizer = AutoTokenizer.from_pretrained(saved)
            else:
                tokenizer = self._train_tokenizer(ctx)
                if ctx.run.is_main:
                    tokenizer.save_pretrained(saved)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer

    def _train_tokenizer(self, ctx):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        o = self.options

        def texts():
            for name in o.tokenizer_data:
                for row in ctx.data(name):
                    if row.get("text") is not None:
                        yield row["text"]
                    for m in row.get("messages") or []:
                        yield m["content"]

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        specials = [EOS, PAD, *o.special_tokens]
        trainer = trainers.BpeTrainer(vocab_size=o.vocab_size, special_tokens=specials, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(texts(), trainer=trainer)
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD,
                                            additional_special_tokens=list(o.special_tokens))
        ctx.reporter.info(f"trained a BPE tokenizer on {', '.join(o.tokenizer_data)}: {len(tokenizer):,} tokens")
        return tokenizer

    def model_config(self, vocab_size: int, **tokens: Any) -> Any:
        """The transformers config this loader builds, for ``vocab_size`` tokens; the plan's
        ``config`` table overrides any field."""
        from transformers import AutoConfig

        o = self.options
        fields = {
            "vocab_size": vocab_size,
            "hidden_size": o.hidden_size,
            "num_hidden_layers": o.num_layers,
            "num_attention_heads": o.num_heads,
            "num_key_value_heads": o.num_kv_heads or o.num_heads,
            "intermediate_size": o.intermediate_size or 4 * o.hidden_size,
            "max_position_embeddings": o.max_position_embeddings,
            "tie_word_embeddings": o.tie_word_embeddings,
            **tokens,
            **o.config,
        }
        return AutoConfig.for_model(o.architecture, **fields)

    def meta_model(self):
        """For ``ftcore estimate``: the model on the meta device and its config."""
        from ftcore_plugins.common.estimate import scratch_meta_model

        return scratch_meta_model(self)


@ftcore.hookimpl
def register_model_loaders(register):
    register(ScratchModelLoader)
