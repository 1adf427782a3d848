"""Model loader ``scratch``: a small randomly initialised model and a tokenizer trained
locally on the plan's own data. No downloads: this is how pre-training from scratch and
the offline quickstart work."""

from __future__ import annotations

from typing import Any

from pydantic import Field

import ftcore
from ftcore.component import Component, Options
from ftcore.types import InputPath

from ftcore_plugins.common.seq2seq import FAMILIES as SEQ2SEQ_ARCHITECTURES
from ftcore_plugins.models import _checks
from ftcore_plugins.models._attention import Attention, attention_problem

EOS, PAD = "<|endoftext|>", "<|pad|>"
VLM_FAMILIES = ("qwen2_5_vl", "qwen3_vl", "mllama", "gemma3", "llava", "idefics3")  # _vlm.FAMILIES, without importing it


class ScratchModelLoader(Component):
    """A randomly initialised model from an architecture config, with a locally trained BPE tokenizer."""

    name = "scratch"

    class Options(Options):
        # a transformers model_type: llama, mistral, qwen2, qwen3, ...; or a vision-language family
        # (qwen2_5_vl, qwen3_vl, mllama, gemma3, llava, idefics3: _vlm.FAMILIES): its image and turn tokens
        # are added to the tokenizer where it lacks them; or an encoder-decoder: t5, mt5, bart (num_layers
        # each for the encoder and the decoder; num_kv_heads does not apply, nor max_position_embeddings to t5)
        architecture: str = "llama"
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
        problems += self.shape_problems()
        if o.tokenizer is not None:
            problem = _checks.tokenizer_folder_problem(o.tokenizer, explicit=True)
            problems += [f"tokenizer: {problem}"] if problem else []
        return problems + ([attention] if attention else [])

    def shape_problems(self) -> list[str]:
        """Attention heads that do not divide, named by the keys the plan sets them with (an option, or
        the ``config`` table's field that overrides it)."""
        o = self.options

        def value(option: str, field: str, default: Any) -> tuple[str, Any]:
            if field in o.config:
                return f"config.{field}", o.config[field]
            return option, default

        hidden = value("hidden_size", "hidden_size", o.hidden_size)
        heads = value("num_heads", "num_attention_heads", o.num_heads)
        kv = value("num_kv_heads", "num_key_value_heads", o.num_kv_heads)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for _, v in (hidden, heads)):
            return []  # a config field of another type: transformers says what it makes of it
        problems = []
        if o.config.get("head_dim") is None and o.config.get("d_kv") is None and hidden[1] % heads[1]:
            near = max(heads[1], round(hidden[1] / heads[1]) * heads[1])
            problems.append(f"{hidden[0]}: {hidden[1]} is not a multiple of {heads[0]} ({heads[1]}), so the heads "
                            f"cannot share the width; use a multiple of {heads[1]}, such as {near}")
        if isinstance(kv[1], int) and not isinstance(kv[1], bool) and kv[1] > 0 and heads[1] % kv[1]:
            divisor = max(d for d in range(1, kv[1] + 1) if heads[1] % d == 0)
            problems.append(f"{kv[0]}: {kv[1]} does not divide {heads[0]} ({heads[1]}): each key/value head must "
                            f"serve the same number of query heads; use a divisor of {heads[1]}, such as {divisor}")
        return problems

    def preflight(self, plan) -> list[str]:
        """Before a run makes its folder: that transformers knows the architecture and builds its config
        from these options (on the meta device: no weights), and that a tokenizer folder reads."""
        o = self.options
        if o.architecture in VLM_FAMILIES:
            problem = _checks.tokenizer_files_problem(o.tokenizer) if o.tokenizer is not None else None
            return [f"tokenizer: {problem}"] if problem else []
        problem = _checks.model_type_problem(o.architecture, False, False)
        if problem:
            return [f"architecture: {problem.replace('unknown model type', 'unknown architecture')}"]
        if o.tokenizer is not None:
            problem = _checks.tokenizer_files_problem(o.tokenizer)
            if problem:
                return [f"tokenizer: {problem}"]
        try:
            import torch

            from ftcore_plugins.common.seq2seq import auto_class

            config = self.model_config(o.vocab_size)
            with torch.device("meta"):
                auto_class(config).from_config(config)
        except Exception as exc:  # noqa: BLE001 - every field is the plan's: what transformers refuses is
            return [f"{self._blamed(exc)}: transformers cannot build this {o.architecture} model: "
                    f"{_checks.one_line(exc)}"]
        return []

    def _blamed(self, exc: BaseException) -> str:
        """The option a config error is most likely about: the width and heads for a head size transformers
        refuses (RoPE wants it even), else the ``config`` table where the plan sets fields, else none."""
        text = str(exc).lower()
        if "head_dim" in text or "hidden size" in text or "attention heads" in text or "rotary" in text:
            return "config.head_dim" if "head_dim" in self.options.config else "hidden_size"
        return "config" if self.options.config else "architecture"

    def load(self, ctx):
        import torch

        from ftcore_plugins.common.seq2seq import auto_class

        o = self.options
        tokenizer = self.load_tokenizer(ctx)
        if o.architecture in VLM_FAMILIES:
            return self._load_vlm(ctx, tokenizer)
        config = self.model_config(len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                   eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        torch.manual_seed(ctx.seed)
        extra = {"attn_implementation": o.attn_implementation} if o.attn_implementation else {}
        model = auto_class(config).from_config(config, dtype=torch.float32, **extra)
        n = sum(p.numel() for p in model.parameters())
        ctx.reporter.info(f"scratch model: {o.architecture}, {o.num_layers} layers, hidden {o.hidden_size}, "
                          f"{n:,} parameters, vocabulary {len(tokenizer):,}")
        return model, tokenizer

    def _load_vlm(self, ctx, tokenizer):
        """A tiny vision-language model of the family (random init), its processor around the tokenizer."""
        import torch

        from ftcore_plugins.models import _vlm

        o = self.options
        torch.manual_seed(ctx.seed)
        model, _ = _vlm.build(o.architecture, tokenizer, hidden_size=o.hidden_size, num_layers=o.num_layers,
                              num_heads=o.num_heads, config=o.config)
        n = sum(p.numel() for p in model.parameters())
        ctx.reporter.info(f"scratch model: {o.architecture} (vision-language), {o.num_layers} layers, hidden "
                          f"{o.hidden_size}, {n:,} parameters, vocabulary {len(tokenizer):,}")
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
        return self.with_processor(tokenizer)

    def with_processor(self, tokenizer):
        """A VLM family's tokenizer: its processor attached around it (image and turn tokens added, the
        family's chat template set); any other tokenizer as it is."""
        o = self.options
        if o.architecture not in VLM_FAMILIES:
            return tokenizer
        from ftcore_plugins.common.vision import attach_processor
        from ftcore_plugins.models import _vlm

        return attach_processor(tokenizer, _vlm.processor_for(o.architecture, tokenizer, o.config))

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

    def _stand_in_tokenizer(self):
        """For shapes before the tokenizer is trained: ``vocab_size`` tokens (a trained one has at most
        that many) with the trained one's special tokens."""
        from tokenizers import Tokenizer, models
        from transformers import PreTrainedTokenizerFast

        o = self.options
        names = list(dict.fromkeys([EOS, PAD, *o.special_tokens]))
        names += [f"<stand-in {i}>" for i in range(len(names), o.vocab_size)]
        words = Tokenizer(models.WordLevel({t: i for i, t in enumerate(names)}, unk_token=EOS))
        return PreTrainedTokenizerFast(tokenizer_object=words, eos_token=EOS, pad_token=PAD,
                                       additional_special_tokens=list(o.special_tokens))

    def model_config(self, vocab_size: int, **tokens: Any) -> Any:
        """The transformers config this loader builds, for ``vocab_size`` tokens; the plan's
        ``config`` table overrides any field."""
        from transformers import AutoConfig

        o = self.options
        if o.architecture in SEQ2SEQ_ARCHITECTURES:
            shape = self._encoder_decoder_fields(tokens)
        else:
            shape = {
                "hidden_size": o.hidden_size,
                "num_hidden_layers": o.num_layers,
                "num_attention_heads": o.num_heads,
                "num_key_value_heads": o.num_kv_heads or o.num_heads,
                "intermediate_size": o.intermediate_size or 4 * o.hidden_size,
                "max_position_embeddings": o.max_position_embeddings,
            }
        fields = {"vocab_size": vocab_size, **shape, "tie_word_embeddings": o.tie_word_embeddings, **tokens, **o.config}
        return AutoConfig.for_model(o.architecture, **fields)

    def _encoder_decoder_fields(self, tokens: dict[str, Any]) -> dict[str, Any]:
        """T5's and BART's own names for the shape options (``num_layers`` each for the encoder and the
        decoder), and the token the decoder starts from: T5's pad token, BART's EOS, as their checkpoints."""
        o = self.options
        inner = o.intermediate_size or 4 * o.hidden_size
        if o.architecture == "bart":
            start = tokens.get("eos_token_id")
            return {"d_model": o.hidden_size, "encoder_layers": o.num_layers, "decoder_layers": o.num_layers,
                    "encoder_attention_heads": o.num_heads, "decoder_attention_heads": o.num_heads,
                    "encoder_ffn_dim": inner, "decoder_ffn_dim": inner,
                    "max_position_embeddings": o.max_position_embeddings,
                    **({"decoder_start_token_id": start, "forced_eos_token_id": start} if start is not None else {})}
        # t5, mt5: relative positions (no max_position_embeddings); each head o.hidden_size / o.num_heads wide
        start = tokens.get("pad_token_id")
        return {"d_model": o.hidden_size, "num_layers": o.num_layers, "num_decoder_layers": o.num_layers,
                "num_heads": o.num_heads, "d_kv": max(1, o.hidden_size // o.num_heads), "d_ff": inner,
                **({"decoder_start_token_id": start} if start is not None else {})}

    def meta_model(self):
        """For ``ftcore estimate``: the model on the meta device and its config."""
        from ftcore_plugins.common.estimate import scratch_meta_model

        o = self.options
        if o.architecture in VLM_FAMILIES:
            from transformers import AutoTokenizer

            from ftcore_plugins.models import _vlm

            tokenizer = AutoTokenizer.from_pretrained(str(o.tokenizer)) if o.tokenizer is not None \
                else self._stand_in_tokenizer()
            model, _ = _vlm.build(o.architecture, tokenizer, hidden_size=o.hidden_size, num_layers=o.num_layers,
                                  num_heads=o.num_heads, config=o.config, device="meta")
            return model, model.config
        return scratch_meta_model(self)


@ftcore.hookimpl
def register_model_loaders(register):
    register(ScratchModelLoader)
