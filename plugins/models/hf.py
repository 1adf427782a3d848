"""Model loader ``hf``: a transformers causal LM from a local folder or a hub id."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import SecretStr, field_validator

import ftcore
from ftcore.component import Component, Options
from ftcore.errors import FtcoreError

from ftcore_plugins.common.model import resolve_model_path
from ftcore_plugins.models._attention import Attention, attention_problem

DTYPES = ("auto", "float32", "bfloat16", "float16")


class HFModelLoader(Component):
    """A transformers causal LM from a local folder (or a hub id where the network allows)."""

    name = "hf"

    class Options(Options):
        path: str
        tokenizer: str | None = None  # defaults to path
        dtype: Literal[DTYPES] = "auto"  # type: ignore[valid-type]
        revision: str | None = None
        trust_remote_code: bool = False  # never on unless the plan says so
        attn_implementation: Attention | None = None  # transformers' default (sdpa) when unset
        token: SecretStr | None = None  # hub token; redacted from the manifest

        _paths = field_validator("path", "tokenizer")(resolve_model_path)

    def check(self, plan) -> list[str]:
        return [p for p in [attention_problem(self.options.attn_implementation)] if p]

    def load(self, ctx):
        from transformers import AutoModelForCausalLM

        o = self.options
        tokenizer = self.load_tokenizer(ctx)
        kwargs = {"dtype": o.dtype, **ctx.quantizer.load_kwargs()}
        if o.attn_implementation:
            kwargs["attn_implementation"] = o.attn_implementation
        stored = self._stored_dtype(kwargs)
        if stored is not None:  # read in its own dtype, then raised tensor by tensor (see _upcast)
            kwargs["dtype"] = stored
        model = self._load("path", AutoModelForCausalLM, o.path, **self._common(), **kwargs)
        if stored is not None:
            from ftcore_plugins.models._upcast import upcast

            import torch

            upcast(model, torch.float32)
        return model, tokenizer

    def _stored_dtype(self, kwargs: dict) -> str | None:
        """The checkpoint's own half-precision dtype when the plan asks for float32 from a local folder
        of safetensors, without a quantizer; else None (transformers converts as it loads)."""
        import json

        o = self.options
        folder = Path(o.path)
        if o.dtype != "float32" or "quantization_config" in kwargs or not folder.is_dir() \
                or not any(folder.glob("*.safetensors")):
            return None
        try:
            config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        stored = config.get("dtype") or config.get("torch_dtype")
        return stored if stored in ("bfloat16", "float16") else None

    def load_tokenizer(self, ctx):
        """The tokenizer alone (``ftcore prepare`` reads no weights)."""
        from transformers import AutoTokenizer

        o = self.options
        tokenizer = self._load("tokenizer" if o.tokenizer else "path", AutoTokenizer, o.tokenizer or o.path,
                               **self._common())
        if tokenizer.pad_token is None:
            # Labels are built from spans, not from the pad mask, so pad == eos is safe here.
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer

    def _common(self) -> dict:
        o = self.options
        return {"revision": o.revision, "trust_remote_code": o.trust_remote_code,
                "token": o.token.get_secret_value() if o.token else None}

    @staticmethod
    def _load(key: str, cls: type, where: str, **kwargs):
        """``cls.from_pretrained(where)``, its failure one line naming the plan key that holds ``where``."""
        try:
            return cls.from_pretrained(where, **kwargs)
        except OSError as exc:
            hint = "" if Path(where).exists() else " (not a local folder, and the hub is unreachable or the id is wrong)"
            raise FtcoreError(f"model.{key}: cannot load {where!r}{hint}: {str(exc).splitlines()[0]}") from exc

    def meta_model(self):
        """For ``ftcore estimate``: the model on the meta device (no weights read) and its config."""
        from ftcore_plugins.common.estimate import hf_meta_model

        return hf_meta_model(self)

    def checkpoint_residue_bytes(self, quantized: bool) -> int:
        """For ``ftcore estimate``: checkpoint file pages that stay resident after loading."""
        from ftcore_plugins.common.estimate import hf_checkpoint_residue_bytes

        return hf_checkpoint_residue_bytes(self, quantized)


@ftcore.hookimpl
def register_model_loaders(register):
    register(HFModelLoader)
