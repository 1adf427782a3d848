"""A finished run's model, rebuilt from its run directory, and answers from it, for ``ftcore chat`` and
``ftcore generate``.

The model comes from the runner's own mechanism (``Runner.model_at``, what evaluators get as
``EvalContext.load_model``): the plan saved in ``manifest.json`` is rebuilt against the installed
plugins, the base model is loaded by the plan's loader and each finished stage's saved output is
restored on top. Exports are read from ``exports.json``. Answers are rendered with the plan's chat
template and its generation prompt and stop at EOS or the template's end-of-turn tokens, exactly as
the ``generation`` evaluator does, so a greedy answer here equals the evaluator's.

Heavy libraries are imported inside functions: commands import this module only in ``run()``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftcore import rundir
from ftcore.errors import FtcoreError, did_you_mean

from ftcore_plugins.common.chat import prompt_text, stop_token_ids

SERVED_EXPORTS = ("merged", "adapter", "gguf")  # the exporters whose output chat and generate can load
PIP_LLAMA_CPP = "pip install llama-cpp-python"
# Highest precision first: the GGUF file chosen when an export wrote several.
GGUF_PREFERENCE = ("f32", "f16", "bf16", "q8_0")
MAX_NEW_TOKENS = 1 << 24  # the bound of a plan's token lengths (ftcore.types.Tokens)


@dataclass
class Sampling:
    """Decoding settings; ``temperature`` 0 is greedy decoding."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: int | None = None

    def check(self) -> str | None:
        """Why these settings are invalid, or None."""
        if self.temperature < 0:
            return f"temperature must be >= 0 (0 is greedy), got {self.temperature}"
        if not 0 < self.top_p <= 1:
            return f"top_p must be in (0, 1], got {self.top_p}"
        if self.max_new_tokens < 1:
            return f"max_new_tokens must be >= 1, got {self.max_new_tokens}"
        if self.max_new_tokens > MAX_NEW_TOKENS:  # beyond any model's context: refused before a model loads
            return f"max_new_tokens must be at most {MAX_NEW_TOKENS:,} (more than any model's context), got " \
                   f"{self.max_new_tokens:,}"
        return None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generate_kwargs(self) -> dict[str, Any]:
        if self.greedy:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p}

    def describe(self) -> str:
        how = "greedy" if self.greedy else f"temperature={self.temperature:g} top_p={self.top_p:g}"
        return f"{how} max_new_tokens={self.max_new_tokens}"


# -- the run -----------------------------------------------------------------------------------------

class Run:
    """A run directory: its saved plan, its stages and exports, and the runner that rebuilds its models."""

    def __init__(self, run_dir: str, console: Any):
        self.shown = run_dir
        self.path = Path(run_dir).expanduser().resolve()
        if not self.path.is_dir():
            raise FtcoreError(f"{run_dir}: no such run directory")
        manifest = rundir.read_json(self.path / rundir.MANIFEST)
        if not isinstance(manifest, dict) or "plan" not in manifest:
            raise FtcoreError(f"{run_dir}: not an ftcore run directory (no readable {rundir.MANIFEST})")
        self.manifest = manifest
        self.console = console
        self.plan, self.pm = saved_plan(self.path, manifest)
        self._runner: Any = None

    @property
    def stages(self) -> list[str]:
        return [s.name for s in self.plan.stages]

    def finished(self, stage: str) -> bool:
        return (self.path / "stages" / stage / rundir.COMPLETE).is_file()

    def resume_hint(self) -> str:
        return f"ftcore run {self.manifest.get('plan_path', 'PLAN')} --resume"

    @property
    def runner(self) -> Any:
        """A runner on this run directory that only rebuilds models: it starts no run and writes nothing."""
        if self._runner is None:
            from ftcore.reporter import Reporter
            from ftcore.runner import Runner

            class Rebuilder(Runner):
                def _notify(self, hook: str, **kwargs: Any) -> None:
                    pass  # not a run: trackers and other lifecycle plugins are not told about it

            runner = Rebuilder(self.plan, self.pm, self.console)
            runner.run_dir = runner.info.run_dir = self.path  # the folder given, wherever the plan put it
            runner.reporter = runner.info.reporter = Reporter(self.console, None, None, runner.info)
            self._runner = runner
        return self._runner

    # -- choosing a model -------------------------------------------------------------------------------
    def check_stage(self, stage: str) -> None:
        if stage != "base" and stage not in self.stages:
            raise FtcoreError(f"{self.shown}: no stage named {stage!r} (stages: {', '.join(['base', *self.stages])})"
                              + did_you_mean(stage, self.stages))
        if stage != "base" and not self.finished(stage):
            raise FtcoreError(f"{self.shown}: stage {stage!r} has not finished (no stages/{stage}/{rundir.COMPLETE}); "
                              f"finish it with: {self.resume_hint()}")

    def final_stage(self) -> str:
        """The last stage, which must have finished: its model is the run's final one."""
        if not self.stages:
            return "base"
        unfinished = [s for s in self.stages if not self.finished(s)]
        if unfinished:
            done = [s for s in self.stages if self.finished(s)]
            other = f"choose a finished one with --stage {done[-1]}, or " if done else ""
            raise FtcoreError(f"{self.shown}: the run has not finished stage {unfinished[0]!r} "
                              f"(status: {self.manifest.get('status', '?')}); {other}finish it with: "
                              f"{self.resume_hint()}")
        return self.stages[-1]

    def export_path(self, name: str) -> tuple[str, Path]:
        """The exporter and path of the export ``name``, checked to exist and to be one chat can serve."""
        entries = {e["name"]: e for e in self.manifest.get("resolved", {}).get("export", [])}
        if name not in entries:
            known = ", ".join(entries) or "none"
            raise FtcoreError(f"{self.shown}: the plan has no export named {name!r} (exports: {known})"
                              + did_you_mean(name, entries))
        exporter = entries[name]["exporter"].rpartition(":")[2]
        if exporter not in SERVED_EXPORTS:
            raise FtcoreError(f"{self.shown}: export {name!r} is a {exporter!r} export; chat and generate serve "
                              f"{', '.join(SERVED_EXPORTS)} exports")
        written = (rundir.read_json(self.path / "exports.json") or {}).get(name)
        path = rundir.stored(self.path, written) if written else Path(entries[name]["path"])
        with contextlib.suppress(ValueError):  # an absolute path inside the run folder, which may have moved
            path = self.path / path.relative_to(self.plan.run_dir)
        if not written or not path.exists():
            raise FtcoreError(f"{self.shown}: export {name!r} was not written ({path} is missing); "
                              f"finish the run with: {self.resume_hint()}")
        return exporter, path

    # -- loading ---------------------------------------------------------------------------------------
    def model(self, stage: str | None = None, export: str | None = None) -> Model:
        """The run's final model, a finished stage's (``"base"``: before training), or an export's."""
        if export is not None:
            exporter, path = self.export_path(export)
            return {"merged": self._merged, "adapter": self._adapter, "gguf": self._gguf}[exporter](export, path)
        stage = stage or self.final_stage()
        self.check_stage(stage)
        model, tokenizer = self.runner.model_at(stage)
        return TransformersModel(stage, _on_device(model), tokenizer, self.runner.template)

    def _merged(self, name: str, path: Path) -> Model:
        from transformers import AutoConfig, AutoTokenizer

        from ftcore_plugins.common.seq2seq import auto_class
        from ftcore_plugins.common.vlm import read_config, vision_model_type

        if vision_model_type(read_config(path)) is not None:  # a VLM, saved with its processor (docs/vision.md)
            from transformers import AutoModelForImageTextToText, AutoProcessor

            from ftcore_plugins.common.vision import attach_processor

            processor = AutoProcessor.from_pretrained(path)
            return TransformersModel(f"export {name}", _on_device(AutoModelForImageTextToText.from_pretrained(path)),
                                     attach_processor(processor.tokenizer, processor), self.runner.template)
        model = auto_class(AutoConfig.from_pretrained(path)).from_pretrained(path)  # a T5/BART as a seq2seq LM
        return TransformersModel(f"export {name}", _on_device(model), AutoTokenizer.from_pretrained(path),
                                 self.runner.template)

    def _adapter(self, name: str, path: Path) -> Model:
        """The adapter export restored, as the runner restores a stage's output, on the model it was
        trained on (rebuilt from the run's files)."""
        model, tokenizer = self.runner.model_at(self.final_stage(), output=path)
        return TransformersModel(f"export {name}", _on_device(model), tokenizer, self.runner.template)

    def _gguf(self, name: str, path: Path) -> Model:
        import importlib.util

        if importlib.util.find_spec("llama_cpp") is None:
            raise FtcoreError(f"--export {name}: serving a GGUF file needs llama-cpp-python, which is not "
                              f"installed: {PIP_LLAMA_CPP}")
        files = sorted(path.glob("*.gguf")) if path.is_dir() else [path]
        if not files:
            raise FtcoreError(f"{self.shown}: export {name!r} has no .gguf file in {path}")
        rank = {t: i for i, t in enumerate(GGUF_PREFERENCE)}
        file = min(files, key=lambda f: rank.get(f.stem.rpartition("-")[2], len(rank)))
        return LlamaCppModel(f"export {name} ({file.name})", file, self.runner.template)


def saved_plan(run_dir: Path, manifest: dict) -> tuple[Any, Any]:
    """The run's plan and the plugin manager: the plan file when it is unchanged since the run (it keeps
    the secrets the manifest redacts), else the plan saved in the manifest, with relative paths
    resolved against the plan file's folder as they were."""
    from ftcore.plugins import plugins_with_warnings
    from ftcore.errors import PlanError
    from ftcore.plan import check_plan, load_plan

    pm, registry = plugins_with_warnings()
    plan_path = Path(manifest.get("plan_path") or run_dir / "plan.toml")
    if plan_path.is_file():
        try:
            plan = load_plan(plan_path, registry)
        except PlanError:
            plan = None
        if plan is not None and plan.fingerprint() == manifest.get("plan_fingerprint"):
            return plan, pm
    shown = f"{run_dir / rundir.MANIFEST} (the run's plan)"
    return check_plan(manifest["plan"], plan_path, registry, shown=shown), pm


def _on_device(model: Any) -> Any:
    """The model in eval mode, on the GPU when there is one and the loader left it on the CPU."""
    import torch

    if torch.cuda.is_available() and next(model.parameters()).device.type == "cpu" \
            and not getattr(model, "is_quantized", False):
        model = model.to("cuda")
    return model.eval()


# -- answering ---------------------------------------------------------------------------------------

@dataclass
class Model:
    """A model, its tokenizer and the run's chat template: renders conversations and answers them."""

    label: str
    tokenizer: Any
    template: Any
    stops: list[int] = field(default_factory=list)

    @property
    def vision(self) -> bool:
        """Whether the model reads images (a vision-language model, with its processor)."""
        from ftcore_plugins.common.vision import processor_of

        return processor_of(self.tokenizer) is not None

    def render(self, messages: list[dict]) -> str:
        """The conversation as the model sees it, ending with the template's generation prompt. For a
        vision-language model, each ``<image>`` placeholder becomes the family's image token (unexpanded)."""
        from ftcore_plugins.common.images import IMAGE
        from ftcore_plugins.common.vision import IMAGE_TEMPLATES, image_template

        if self.vision and (getattr(self.template, "name", None) in IMAGE_TEMPLATES
                            or any(IMAGE in str(m.get("content")) for m in messages)):  # as the sft collator renders
            return prompt_text({"messages": messages}, self.tokenizer, image_template(self.template))
        return prompt_text({"messages": messages}, self.tokenizer, self.template)

    def prompt_tokens(self, prompt: str, images: list | None = None) -> int:
        """How many tokens the rendered ``prompt`` takes, its images' tokens included."""
        return len(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])

    def stream(self, prompt: str, sampling: Sampling, images: list | None = None) -> Iterator[str]:
        """The answer to the rendered ``prompt`` (``images``: the references of its images, one per image
        token, in order), piece by piece as it is generated."""
        raise NotImplementedError

    def answers(self, prompts: list[str], sampling: Sampling, batch_size: int, progress: Any,
                images: list[list] | None = None) -> list[str]:
        """Answers to rendered ``prompts`` (``images``: each prompt's image references), in order;
        ``progress.advance(n)`` after each batch."""
        out = []
        for k, prompt in enumerate(prompts):
            out.append("".join(self.stream(prompt, sampling, images[k] if images else None)).strip())
            progress.advance(1)
        return out


class TransformersModel(Model):
    def __init__(self, label: str, model: Any, tokenizer: Any, template: Any):
        super().__init__(label, tokenizer, template, stop_token_ids(tokenizer, template))
        self.model = model

    def _generate_args(self, sampling: Sampling) -> dict[str, Any]:
        return {"max_new_tokens": sampling.max_new_tokens, "eos_token_id": self.stops,
                "pad_token_id": self.tokenizer.pad_token_id, **sampling.generate_kwargs()}

    def inputs(self, prompts: list[str], images: list[list] | None = None) -> Any:
        """The model's inputs for rendered ``prompts``, left-padded (``images``: each prompt's image references);
        an encoder-decoder's as its encoder read them in training (``common/seq2seq.py``)."""
        from ftcore_plugins.common.seq2seq import encoder_batch, is_encoder_decoder
        from ftcore_plugins.common.vision import prompt_inputs

        device = next(self.model.parameters()).device
        if is_encoder_decoder(self.model) and not images:
            return encoder_batch(self.tokenizer, prompts).to(device)
        return prompt_inputs(self.tokenizer, prompts, images).to(device)

    def prompt_tokens(self, prompt: str, images: list | None = None) -> int:
        return int(self.inputs([prompt], [images] if images else None)["input_ids"].shape[1])

    def stream(self, prompt: str, sampling: Sampling, images: list | None = None) -> Iterator[str]:
        """transformers' TextIteratorStreamer, fed by ``generate`` in a thread. Closing the iterator early
        (Ctrl-C) stops the generation at its next token."""
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer

        stop = threading.Event()

        class Stop(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return torch.full((input_ids.shape[0],), stop.is_set(), dtype=torch.bool, device=input_ids.device)

        batch = self.inputs([prompt], [images] if images else None)
        streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
        failure: list[BaseException] = []

        def work() -> None:
            try:
                with torch.no_grad():
                    self.model.generate(**batch, streamer=streamer, stopping_criteria=StoppingCriteriaList([Stop()]),
                                        **self._generate_args(sampling))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                failure.append(exc)
                streamer.end()  # or the reader below would wait for ever

        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        thread = threading.Thread(target=work, daemon=True)
        thread.start()
        try:
            yield from streamer
        finally:
            stop.set()
            thread.join()
        if failure:
            raise failure[0]

    def answers(self, prompts: list[str], sampling: Sampling, batch_size: int, progress: Any,
                images: list[list] | None = None) -> list[str]:
        """Batched as the ``generation`` evaluator batches (``common/generate.py``); prompts with images go
        through the processor, batch by batch (images decoded one batch at a time)."""
        from ftcore_plugins.common.generate import batched_answers

        encode = None
        if images is not None:
            def encode(start: int, texts: list[str]) -> Any:
                return self.inputs(texts, images[start:start + len(texts)])
        return batched_answers(self.model, self.tokenizer, prompts, batch_size=batch_size, progress=progress,
                               seed=sampling.seed, encode=encode, **self._generate_args(sampling))


GGML_LOG_ERROR, GGML_LOG_CONT = 4, 5  # ggml's enum ggml_log_level (NONE, DEBUG, INFO, WARN, ERROR, CONT)


_LOADING = threading.Lock()  # load_gguf's, below


def load_gguf(file: Path | str, **kwargs: Any) -> Any:
    """``llama_cpp.Llama(file, **kwargs)`` with llama.cpp's extra CPU buffer types off (its weight
    repacking; AMX on Intel Xeons): with them, llama-cpp-python 0.3.36 segfaults evaluating the q8_0
    files of small models on an AMX CPU, while a plain CPU buffer computes the same logits (to 1e-2
    of the f16 file's here). The switch is a model parameter ``Llama`` does not expose. A file llama.cpp
    cannot load raises ``ValueError`` with llama.cpp's own reason from its log."""
    import ctypes

    import llama_cpp
    import llama_cpp._logger
    from llama_cpp import llama_cpp as lib

    # The switch and the log callback are process-wide: one load at a time, or a thread's reason goes to another.
    with _LOADING:
        return _load_gguf(file, llama_cpp, lib, ctypes, **kwargs)


def _load_gguf(file: Path | str, llama_cpp: Any, lib: Any, ctypes: Any, **kwargs: Any) -> Any:
    default = lib.llama_model_default_params

    def params() -> Any:
        p = default()
        if hasattr(p, "use_extra_bufts"):
            p.use_extra_bufts = False
        return p

    lib.llama_model_default_params = params
    errors: list[str] = []
    level = [0]

    @lib.llama_log_callback
    def keep_errors(at: int, text: bytes, user_data: Any) -> None:
        # llama.cpp says why a file does not load in its log (ggml's GGML_LOG_LEVEL_ERROR, 4; continued at
        # 5), and llama-cpp-python raises only "Failed to load model from file" (its logger's table still
        # has ggml's older levels, so it takes errors for debug lines); its logger still gets every line.
        if at == GGML_LOG_ERROR or (at == GGML_LOG_CONT and level[0] == GGML_LOG_ERROR):
            errors.append(text.decode("utf-8", "replace"))
        level[0] = at if at != GGML_LOG_CONT else level[0]
        llama_cpp._logger.llama_log_callback(at, text, user_data)

    lib.llama_log_set(keep_errors, ctypes.c_void_p(0))
    try:
        return llama_cpp.Llama(str(file), **kwargs)
    except ValueError as exc:
        reason = " ".join("".join(errors).split())
        if reason:
            raise ValueError(f"{exc}: {reason}") from exc
        raise
    finally:
        lib.llama_model_default_params = default
        lib.llama_log_set(llama_cpp._logger.llama_log_callback, ctypes.c_void_p(0))


class LlamaCppModel(Model):
    """A GGUF file served by llama.cpp (llama-cpp-python). The prompt is rendered by the plan's template
    and tokenized by the tokenizer embedded in the file (transformers reads it), so llama.cpp gets the ids
    transformers would; generation stops at the same tokens and is decoded by transformers' streamer."""

    def __init__(self, label: str, file: Path, template: Any):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
        super().__init__(label, tokenizer, template, stop_token_ids(tokenizer, template))
        self.llm = load_gguf(file, n_ctx=0, verbose=False)  # n_ctx 0: the model's own context

    def stream(self, prompt: str, sampling: Sampling, images: list | None = None) -> Iterator[str]:
        import torch
        from transformers import TextStreamer

        pieces: list[str] = []

        class Collect(TextStreamer):
            def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
                pieces.append(text)

        streamer = Collect(self.tokenizer, skip_prompt=False, skip_special_tokens=True)
        ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if sampling.seed is not None:
            self.llm.set_seed(sampling.seed)
        # top_k 1 is argmax whatever else the sampler chain holds; sampling uses temperature and top_p alone.
        args = dict(temp=0.0, top_k=1) if sampling.greedy else dict(temp=sampling.temperature, top_p=sampling.top_p,
                                                                     top_k=0, min_p=0.0)
        for n, token in enumerate(self.llm.generate(ids, repeat_penalty=1.0, reset=True, **args)):
            if token in self.stops:
                break
            streamer.put(torch.tensor([token]))
            yield from pieces
            pieces.clear()
            if n + 1 >= sampling.max_new_tokens:
                break
        streamer.end()
        yield from pieces
