"""Model loader ``hf``: a transformers causal LM from a local folder or a hub id; a vision-language model
(an image-text-to-text config with a vision tower) from a local folder, with its processor; an
encoder-decoder (T5, Flan-T5, mT5, BART: ``is_encoder_decoder`` in its config) as a seq2seq LM."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import SecretStr, field_validator

import ftcore
from ftcore.component import Component, Options
from ftcore.errors import FtcoreError, PlanError

from ftcore_plugins.common.model import _in_hub_cache, _offline, resolve_model_path
from ftcore_plugins.common.seq2seq import FAMILIES, config_encoder_decoder, model_config
from ftcore_plugins.models import _checks, _prequantized
from ftcore_plugins.models._attention import Attention, attention_problem
from ftcore_plugins.models._rope import RopeScaling, model_problem, scale, transformers_refusal

DTYPES = ("auto", "float32", "bfloat16", "float16")
HUB_TIMEOUT_S = 10  # one look-up, no retries: the hub answers, or a run does not wait on it
_UNREACHABLE: dict[str, str] = {}  # hub endpoints this process found unreachable, and why


class HFModelLoader(Component):
    """A transformers causal LM (or a T5/BART encoder-decoder) from a local folder (or a hub id where the
    network allows)."""

    name = "hf"
    tensor_parallel = True  # under [distributed] tp_size it loads each process's split of the weights (load)

    class Options(Options):
        path: str
        tokenizer: str | None = None  # defaults to path
        dtype: Literal[DTYPES] = "auto"  # type: ignore[valid-type]
        revision: str | None = None
        trust_remote_code: bool = False  # never on unless the plan says so
        attn_implementation: Attention | None = None  # transformers' default (sdpa) when unset
        token: SecretStr | None = None  # hub token; redacted from the manifest
        rope_scaling: RopeScaling | None = None  # a longer context: { type = "yarn", factor = 4.0 } (_rope.py)

        _paths = field_validator("path", "tokenizer")(resolve_model_path)

    def check(self, plan) -> list[str]:
        """What the local folders show without loading anything (see ``_checks``)."""
        o = self.options
        problems = [p for p in [attention_problem(o.attn_implementation)] if p]
        if Path(o.path).is_absolute() and Path(o.path).exists():  # a local folder (else a hub id)
            problems += [f"path: {p}" for p in _checks.model_folder_problems(Path(o.path))]
        if o.tokenizer and Path(o.tokenizer).is_absolute() and Path(o.tokenizer).exists():
            problem = _checks.tokenizer_folder_problem(Path(o.tokenizer), explicit=True)
            problems += [f"tokenizer: {problem}"] if problem else []
        config = model_config(o.path, o.revision)
        if o.rope_scaling is not None:
            problems += self._rope_problems(config)
        where = Path(o.path) / "config.json" if Path(o.path).is_dir() else f"{o.path}'s config.json"
        problems += [f"path: {p}" for p in _prequantized.problems(config, plan, str(where))]
        return problems

    def _rope_problems(self, config: dict | None) -> list[str]:
        """``rope_scaling`` against the model's config (a dict; None where none can be read without loading:
        the load checks it then)."""
        o = self.options
        where = Path(o.path) / "config.json" if Path(o.path).is_dir() else f"{o.path}'s config.json"
        problem = model_problem(config, str(where)) if config is not None else None
        if problem:
            return [f"rope_scaling: {problem}"]
        return [f"rope_scaling.{p}" for p in o.rope_scaling.problems(config)]

    def preflight(self, plan) -> list[str]:
        """Before a run makes its folder: what a run needs of the folders beyond ``check()`` (weights, a
        tokenizer that reads, a model type transformers knows), and, for a hub id, one look-up on the hub,
        so that a model it cannot serve is one line now rather than minutes of retries later."""
        o = self.options
        problems = []
        local = Path(o.path).is_absolute() and Path(o.path).is_dir()
        if local:
            problem = _checks.weights_problem(Path(o.path))
            config, _ = _checks.read_config(Path(o.path))
            if problem is None and config is not None:
                problem = _checks.model_type_problem(config.get("model_type"), o.trust_remote_code,
                                                     "auto_map" in config) or self._encoder_decoder_problem(config)
                problem = problem and f"{Path(o.path) / 'config.json'}: {problem}"
            if problem is None and config is not None and o.rope_scaling is not None:
                loaded = self._local_config(Path(o.path))  # as transformers reads it (older formats converted)
                rope = self._loaded_rope_problems(loaded) if loaded is not None else []
                if rope:
                    return rope
            if problem is None and config is not None:
                problem = self._config_against_weights(Path(o.path), config)
            problems += [f"path: {problem}"] if problem else []
        else:
            problems += self._hub_problems("path", o.path, plan)
        key, where = ("tokenizer", o.tokenizer) if o.tokenizer else ("path", o.path)
        if Path(where).is_absolute() and Path(where).exists() and not (key == "path" and problems):
            problem = _checks.tokenizer_folder_problem(Path(where), explicit=key == "tokenizer") \
                or _checks.tokenizer_files_problem(Path(where), parse=False) or self._read_tokenizer(plan, Path(where))
            problems += [f"{key}: {problem}"] if problem else []
        elif o.tokenizer and o.tokenizer != o.path:
            problems += self._hub_problems("tokenizer", o.tokenizer, plan)
        return problems

    def _read_tokenizer(self, plan, folder: Path) -> str | None:
        """Whether the tokenizer reads, by reading it as the run will; the run then takes this one (reading
        Llama 3's is seconds) instead of reading the files again."""
        from ftcore_plugins.common.run_data import lend_tokenizer

        try:
            tokenizer = self.load_tokenizer(None)
        except FtcoreError as exc:
            file = folder / "tokenizer.json"
            return f"{file if file.is_file() else folder} cannot be read: {_checks.one_line(exc.__cause__ or exc)}"
        if getattr(plan, "run_dir", None) is not None:  # a run's plan (not a check's stand-in)
            lend_tokenizer(plan.run_dir, self.options, tokenizer)
        return None

    def _local_config(self, folder: Path) -> Any:
        """The folder's config as transformers reads it; None where it cannot (``_config_against_weights`` says
        why)."""
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(folder, trust_remote_code=self.options.trust_remote_code,
                                              local_files_only=True)
        except Exception:  # noqa: BLE001 - reported by the meta model's build
            return None

    def _config_against_weights(self, folder: Path, config: dict) -> str | None:
        """Whether transformers builds the model ``config.json`` describes (on the meta device), and its
        tensors have the shapes the safetensors headers give: a config edited apart from its weights (its
        heads, its width) is one line here, not a size mismatch deep in loading."""
        try:
            model, _ = self.meta_model()
        except FtcoreError as exc:  # "model.path: cannot read the config of ...": said as check() says it
            return str(exc).split(": ", 1)[-1]
        except Exception as exc:  # noqa: BLE001 - transformers refuses the config: the folder's problem
            return f"{folder / 'config.json'}: transformers cannot build this model: {_checks.one_line(exc)}"
        if "quantization_config" in config:  # packed quantized weights have shapes of their own
            return None
        stored = _checks.safetensors_shapes(folder)
        for name, tensor in model.state_dict().items():
            shape, file = stored.get(name, (None, None))
            if shape is not None and tuple(shape) != tuple(tensor.shape):
                return (f"{folder / 'config.json'} does not match the weights: {name} is {list(shape)} in {file}, "
                        f"{list(tensor.shape)} by the config")
        return None

    def _hub_problems(self, key: str, repo: str, plan) -> list[str]:
        """A hub id the hub cannot serve: unreachable (and not in the local cache), no such model, no such
        revision. Offline (``HF_HUB_OFFLINE``), ``check()`` already refused an id the cache lacks."""
        if _offline():
            return []
        from huggingface_hub import constants

        endpoint = constants.ENDPOINT
        local = (plan.base_dir / repo).resolve()
        why = _UNREACHABLE.get(endpoint)
        if why is None:
            try:
                from huggingface_hub import HfApi

                HfApi(endpoint=endpoint).model_info(repo, revision=self.options.revision, timeout=HUB_TIMEOUT_S,
                                                    token=self._common()["token"])
                return []
            except Exception as exc:  # noqa: BLE001 - sorted below; anything else is the network's
                from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, RepositoryNotFoundError,
                                                    RevisionNotFoundError)

                if isinstance(exc, GatedRepoError):
                    return []  # the download says how to get access, with the model's own words
                if isinstance(exc, RevisionNotFoundError):
                    return [f"revision: {repo!r} has no revision {self.options.revision!r} on the Hugging Face hub"]
                if isinstance(exc, RepositoryNotFoundError):
                    return [f"{key}: no such folder: {local}, nor a model {repo!r} on the Hugging Face hub (or it is "
                            "private: set token, or log in with `hf auth login`)"]
                if isinstance(exc, HfHubHTTPError) and getattr(exc.response, "status_code", 0) < 500:
                    return []  # the hub answered something else: the download decides
                why = _UNREACHABLE[endpoint] = _checks.one_line(exc, 120)
        if _in_hub_cache(repo):
            return []  # loaded from the cache alone (``_common``: local_files_only)
        return [f"{key}: no such folder: {local}, and the Hugging Face hub ({endpoint}) cannot be reached to "
                f"fetch {repo!r} ({why}); download it where the hub is reachable, or name a local folder"]

    @staticmethod
    def _encoder_decoder_problem(config: dict) -> str | None:
        """An encoder-decoder of a family ftcore does not train (a causal LM of its decoder alone would load)."""
        kind = config_encoder_decoder(config)
        if kind is None or kind in FAMILIES:
            return None
        return (f"model type {kind!r} is an encoder-decoder, and ftcore trains causal LMs and the encoder-decoders "
                f"{', '.join(FAMILIES)}")

    def encoder_decoder(self, ctx: Any = None) -> bool:
        """Whether ``path`` holds an encoder-decoder (T5, BART: loaded as a seq2seq LM), from its config.json,
        or from the hub when the local cache has none (with ``ctx``, as a run loads it)."""
        o = self.options
        config = model_config(o.path, o.revision)
        if config is None and ctx is not None and not Path(o.path).exists():
            from transformers import AutoConfig

            loaded = self._load("path", AutoConfig, o.path, ctx, **self._common())
            return bool(getattr(loaded, "is_encoder_decoder", False))
        return config_encoder_decoder(config) is not None

    def vision(self) -> bool:
        """Whether ``path`` holds a vision-language model (loaded with its processor)."""
        config, _ = _checks.read_config(Path(self.options.path)) if Path(self.options.path).is_dir() else (None, None)
        return config is not None and _checks.is_vlm_config(config)

    def load(self, ctx):
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSeq2SeqLM

        o = self.options
        tokenizer = self.load_tokenizer(ctx)
        kwargs = {"dtype": o.dtype, **ctx.quantizer.load_kwargs(),
                  **_prequantized.load_kwargs(model_config(o.path, o.revision))}
        if o.attn_implementation:
            kwargs["attn_implementation"] = o.attn_implementation
        d = getattr(getattr(getattr(ctx, "run", None), "plan", None), "distributed", None)
        if d is not None and d.tp_size > 1 and d.processes > 1:  # each layer's weights split over the processes
            from transformers import DistributedConfig

            # the model's own plan (its config's base_model_tp_plan); from_pretrained's own tp_plan is deprecated
            kwargs["distributed_config"] = DistributedConfig(tp_plan="auto", tp_size=d.tp_size)
        stored = self._stored_dtype(kwargs)
        if stored is not None:  # read in its own dtype, then raised tensor by tensor (see _upcast)
            kwargs["dtype"] = stored
        if self.vision() and kwargs.get("quantization_config") is not None:
            from ftcore_plugins.common.vision import keep_vision_unquantized

            kwargs["quantization_config"] = keep_vision_unquantized(kwargs["quantization_config"], self.meta_model()[0])
        model_cls = AutoModelForImageTextToText if self.vision() else \
            AutoModelForSeq2SeqLM if self.encoder_decoder(ctx) else AutoModelForCausalLM
        if o.rope_scaling is not None:  # the weights load into the model with the longer context
            from transformers import AutoConfig

            kwargs["config"] = self.configure(self._load("path", AutoConfig, o.path, ctx, **self._common()), ctx)
        model = self._load("path", model_cls, o.path, ctx, **self._common(), **kwargs)
        if stored is not None:
            from ftcore_plugins.models._upcast import upcast

            import torch

            upcast(model, torch.float32)
        return model, tokenizer

    def configure(self, config: Any, ctx: Any = None) -> Any:
        """The model's config (a transformers config) as the plan changes it before a model is built from it:
        its ``rope_scaling`` (``_rope.py``). A model that cannot take that is refused in one line naming the key."""
        o = self.options
        if o.rope_scaling is None:
            return config
        problems = self._loaded_rope_problems(config)
        if problems:
            key, _, message = problems[0].partition(": ")
            raise self._refusal(ctx, key, message)
        return scale(config, o.rope_scaling)

    def _loaded_rope_problems(self, config: Any) -> list[str]:
        """``rope_scaling`` against the config as transformers reads it: what ``check()`` sees in config.json (a
        hub id's, an older format converted), then what the family's own config check says."""
        problems = self._rope_problems(config.to_dict())
        refusal = None if problems else transformers_refusal(config, self.options.rope_scaling)
        return problems + ([f"rope_scaling: {refusal}"] if refusal else [])

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
        """The tokenizer alone (``ftcore prepare`` reads no weights); in a run, the one read before (by the
        pre-flight or the data check) where it was lent on."""
        from transformers import AutoTokenizer

        from ftcore_plugins.common.run_data import borrow_tokenizer

        o = self.options
        run = getattr(ctx, "run", None)
        lent = borrow_tokenizer(run.run_dir, o) if run is not None else None
        if lent is not None:
            return lent
        processor = None
        if self.vision():  # a VLM: its processor (image processor and tokenizer) from the folder
            from transformers import AutoProcessor

            from ftcore_plugins.common.vision import attach_processor

            processor = self._load("tokenizer" if o.tokenizer else "path", AutoProcessor, o.tokenizer or o.path, ctx,
                                   **self._common())
            tokenizer = attach_processor(processor.tokenizer, processor)
            if not getattr(tokenizer, "chat_template", None):
                tokenizer.chat_template = getattr(processor, "chat_template", None)  # template "native" renders with it
        else:
            tokenizer = self._load("tokenizer" if o.tokenizer else "path", AutoTokenizer, o.tokenizer or o.path, ctx,
                                   **self._common())
        if tokenizer.pad_token is None:
            # Labels are built from spans, not from the pad mask, so pad == eos is safe here.
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer

    def _common(self) -> dict:
        o = self.options
        common: dict[str, Any] = {"revision": o.revision, "trust_remote_code": o.trust_remote_code,
                                  "token": o.token.get_secret_value() if o.token else None}
        if _UNREACHABLE and _hub_endpoint() in _UNREACHABLE:  # the preflight found no hub: the cache alone
            common["local_files_only"] = True
        return common

    def _load(self, key: str, cls: type, where: str, ctx: Any = None, **kwargs):
        """``cls.from_pretrained(where)``, its failure one line naming the plan key that holds ``where``
        (and the plan file, when ``ctx`` has the run): a folder or file transformers cannot read is bad
        input (exit 2), not a plugin failure."""
        try:
            return cls.from_pretrained(where, **kwargs)
        except Exception as exc:
            if not _bad_input(exc):
                raise
            hint = "" if Path(where).exists() else \
                " (not a local folder, and the hub is unreachable or the id is wrong)"
            raise self._refusal(ctx, key, f"cannot load {where!r}{hint}: {_checks.one_line(exc)}") from exc

    @staticmethod
    def _refusal(ctx: Any, key: str, message: str) -> FtcoreError:
        """Bad input under the plan key ``model.<key>``: a PlanError naming the plan file where ``ctx`` has the
        run (exit 2)."""
        plan = getattr(getattr(ctx, "run", None), "plan", None)
        if plan is not None and hasattr(plan, "problem"):
            return PlanError([plan.problem(f"model.{key}", message)])
        return FtcoreError(f"model.{key}: {message}")

    def meta_model(self):
        """For ``ftcore estimate``: the model on the meta device (no weights read) and its config."""
        from ftcore_plugins.common.estimate import hf_meta_model

        return hf_meta_model(self)

    def checkpoint_residue_bytes(self, quantized: bool) -> int:
        """For ``ftcore estimate``: checkpoint file pages that stay resident after loading."""
        from ftcore_plugins.common.estimate import hf_checkpoint_residue_bytes

        return hf_checkpoint_residue_bytes(self, quantized)


def _hub_endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _bad_input(exc: BaseException) -> bool:
    """Whether a ``from_pretrained`` failure is the files' (or the id's) fault: what transformers, the
    hub client, safetensors and tokenizers raise for a missing, unreadable or inconsistent file. Not
    memory or a device, which are the machine's."""
    if isinstance(exc, (MemoryError, RecursionError)) or "out of memory" in str(exc).lower():
        return False
    if isinstance(exc, (OSError, ValueError, KeyError)):
        return True
    names = {c.__name__ for c in type(exc).__mro__}
    # safetensors' SafetensorError, the tokenizers library's plain Exception, json's errors, a strict config.
    return bool(names & {"SafetensorError", "JSONDecodeError", "StrictDataclassClassValidationError"}) \
        or type(exc) is Exception


@ftcore.hookimpl
def register_model_loaders(register):
    register(HFModelLoader)
