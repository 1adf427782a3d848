"""The bad-input corpus: malformed plans and data files, each refused with one line before work starts.

Every case breaks the small valid project of ``test_plan_errors`` in one way and runs the CLI's
``main`` on it. Each must exit with status 2, print exactly one line on stderr (no traceback) naming the
plan or data file and the key, line or row, leave every file outside ``runs/`` as it was, and leave no
run folder that would stop the next ``ftcore run`` (none at all, or one that failed before training,
which the next run replaces).

Most cases call ``ftcore.cli.main`` in the test's process (a fresh ``python -m ftcore`` imports torch and
transformers again for every case: 20-40 s each on a busy machine), with the process's own stderr (file
descriptor 2) captured and whatever the CLI changes in the process (environment, logging, warnings
filters, signal handlers, working folder) put back after each call. ``PROCESS`` names the cases that run
``python -m ftcore`` for real instead: at least one of every class of bad input in each test, so the real
path (the exit status of the process, its one stderr line, no traceback) stays covered, and every case
whose environment the libraries read once, when they are imported (the Hugging Face hub's address and
cache).

The plan cases of ``test_plan_errors.CASES`` belong to the corpus too; ``CLASS_OF`` sorts them into
the classes below, and ``test_the_corpus_covers_every_class`` counts them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from test_plan_errors import BASE, CASES, EVALUATE, ROWS, append, snapshot, sub, write_project

from ftcore import rundir

CLASSES = {
    "encoding": "the plan file itself: TOML syntax, encoding, a missing file",
    "names": "unknown keys, components and tables, with a suggestion",
    "types": "a value of the wrong type",
    "numbers": "numbers out of bounds: inf, nan, zero, negative, too large",
    "references": "names of data, stages, phases and requirements that do not resolve",
    "paths": "paths that do not exist, or that a file stands in the way of",
    "model": "the model's files and shapes: context length, target modules, adapter rank, heads, architecture, "
             "config, weights, tokenizer (from the files, then on the meta model)",
    "data": "data files: bad JSON, encodings, rows the trainer cannot use",
}

CLASS_OF = {  # test_plan_errors.CASES
    "toml-syntax": "encoding", "unknown-trainer": "names", "unknown-model-loader": "names",
    "unknown-trainer-option": "names", "unknown-adapter-option": "names", "unknown-top-level-key": "names",
    "unknown-run-key": "names", "wrong-type-epochs": "types", "wrong-type-lora-r": "types",
    "wrong-type-bool": "types", "wrong-type-run-seed": "types", "wrong-type-union": "types",
    "wrong-type-list-item": "types", "missing-data-file": "paths", "data-without-path": "names",
    "stage-without-trainer": "names", "no-model-table": "names", "stage-undefined-data": "references",
    "evaluate-undefined-data": "references", "bad-when": "references", "duplicate-stage-names": "references",
    "duplicate-evaluation-names": "references", "stage-not-a-table": "types", "stage-adapter-not-a-table": "types",
    "quantizer-not-a-table": "types", "requires-not-installed": "references", "requires-too-old": "references",
    "requires-invalid": "references", "adapter-export-after-full-fine-tune": "references",
    "export-name-not-a-folder": "paths", "unusable-run-name": "paths", "unusable-output-dir": "paths",
    "scratch-without-tokenizer": "names", "scratch-tokenizer-data-undefined": "references",
}

# Plans `validate` refuses: (class, id, mutation, the whole line after "<plan>: ", and for a TOML error its
# line number: "<plan>:<line>: ...").
VALIDATE = [
    ("numbers", "epochs-inf", sub("epochs = 1", "epochs = inf"),
     "stage[0].epochs: input should be a finite number (got inf)"),
    ("numbers", "epochs-nan", sub("epochs = 1", "epochs = nan"),
     "stage[0].epochs: input should be a finite number (got nan)"),
    ("numbers", "epochs-too-many", sub("epochs = 1", "epochs = 1e9"),
     "stage[0].epochs: input should be less than or equal to 10000 (got 1000000000.0)"),
    ("numbers", "learning-rate-zero", sub("learning_rate = 1e-3", "learning_rate = 0"),
     "stage[0].learning_rate: input should be greater than 0 (got 0)"),
    ("numbers", "learning-rate-negative", sub("learning_rate = 1e-3", "learning_rate = -1e-3"),
     "stage[0].learning_rate: input should be greater than 0 (got -0.001)"),
    ("numbers", "learning-rate-above-one", sub("learning_rate = 1e-3", "learning_rate = 3"),
     "stage[0].learning_rate: input should be less than or equal to 1 (got 3)"),
    ("numbers", "learning-rate-inf", sub("learning_rate = 1e-3", "learning_rate = -inf"),
     "stage[0].learning_rate: input should be a finite number (got -inf)"),
    ("numbers", "batch-size-zero", sub("epochs = 1", "epochs = 1\nbatch_size = 0"),
     "stage[0].batch_size: input should be greater than or equal to 1 (got 0)"),
    ("numbers", "batch-size-huge", sub("epochs = 1", "epochs = 1\nbatch_size = 10000000"),
     "stage[0].batch_size: input should be less than or equal to 65536 (got 10000000)"),
    ("numbers", "max-length-float-huge", sub("epochs = 1", "epochs = 1\nmax_length = 1e12"),
     "stage[0].max_length: input should be a valid integer (got 1000000000000.0)"),
    ("numbers", "max-length-huge", sub("epochs = 1", "epochs = 1\nmax_length = 1000000000000"),
     "stage[0].max_length: input should be less than or equal to 16777216 (got 1000000000000)"),
    ("numbers", "max-length-zero", sub("epochs = 1", "epochs = 1\nmax_length = 0"),
     "stage[0].max_length: input should be greater than or equal to 1 (got 0)"),
    ("numbers", "warmup-ratio-one", sub("epochs = 1", "epochs = 1\nwarmup_ratio = 1.0"),
     "stage[0].warmup_ratio: input should be less than 1 (got 1.0)"),
    ("numbers", "grad-accumulation-zero", sub("epochs = 1", "epochs = 1\ngradient_accumulation_steps = 0"),
     "stage[0].gradient_accumulation_steps: input should be greater than or equal to 1 (got 0)"),
    ("numbers", "max-steps-negative", sub("epochs = 1", "epochs = 1\nmax_steps = -5"),
     "stage[0].max_steps: input should be greater than or equal to -1 (got -5)"),
    ("numbers", "lora-r-zero", sub("r = 8", "r = 0"),
     "stage[0].adapter.r: input should be greater than 0 (got 0)"),
    ("numbers", "lora-dropout-one", sub("r = 8", "r = 8, lora_dropout = 1.0"),
     "stage[0].adapter.lora_dropout: input should be less than 1 (got 1.0)"),
    ("numbers", "hidden-size-zero", sub("hidden_size = 32", "hidden_size = 0"),
     "model.hidden_size: input should be greater than or equal to 1 (got 0)"),
    ("numbers", "vocab-size-nan", sub("vocab_size = 300", "vocab_size = nan"),
     "model.vocab_size: input should be a valid integer (got nan)"),
    ("numbers", "evaluator-batch-size-zero", append(EVALUATE + "batch_size = 0\n"),
     "evaluate[0].batch_size: input should be greater than or equal to 1 (got 0)"),
    ("numbers", "evaluator-max-new-tokens-zero",
     append('\n[[evaluate]]\nuse = "exact_match"\ndata = "train"\nmax_new_tokens = 0\n'),
     "evaluate[0].max_new_tokens: input should be greater than or equal to 1 (got 0)"),
    ("numbers", "guard-spike-factor-one", sub("epochs = 1", "epochs = 1\nguard_spike_factor = 1.0"),
     "stage[0].guard_spike_factor: input should be greater than 1 (got 1.0)"),
    ("numbers", "logging-steps-zero", sub("epochs = 1", "epochs = 1\nlogging_steps = 0"),
     "stage[0].logging_steps: input should be greater than or equal to 1 (got 0)"),
    ("names", "unknown-template", sub('use = "chatml"', 'use = "chatlm"'),
     "template.use: unknown chat template 'chatlm'; did you mean 'chatml'? Available: "),
    ("names", "unknown-data-source", sub('use = "jsonl"', 'use = "jsonlines"'),
     "data.train.use: unknown data source 'jsonlines'; did you mean 'jsonl'? Available: "),
    ("names", "unknown-evaluator", append(EVALUATE.replace('"perplexity"', '"perplexty"')),
     "evaluate[0].use: unknown evaluator 'perplexty'; did you mean 'perplexity'? Available: "),
    ("names", "unknown-exporter", append('\n[[export]]\nuse = "merge"\n'),
     "export[0].use: unknown exporter 'merge'; did you mean 'merged'? Available: "),
    ("names", "unknown-adapter", sub('adapter = { use = "lora", r = 8 }', 'adapter = "lroa"'),
     "stage[0].adapter.use: unknown adapter 'lroa'; did you mean 'lora'? Available: "),
    ("types", "learning-rate-string", sub("learning_rate = 1e-3", 'learning_rate = "1e-3"'),
     "stage[0].learning_rate: input should be a valid number (got '1e-3')"),
    ("types", "data-not-a-table",
     lambda t: "data = 3\n" + sub('[data.train]\nuse = "jsonl"\npath = "train.jsonl"\n', "")(t),
     "data: must be a table ([data]), got an integer"),
    ("encoding", "duplicate-key", sub("epochs = 1", "epochs = 1\nepochs = 2"),
     "invalid TOML: Cannot overwrite a value (column 11)", 27),
    ("encoding", "unterminated-string", sub('name = "tiny"', 'name = "tiny'),
     "invalid TOML: Illegal character '\\n' (column 13)", 2),
    ("types", "target-modules-empty-list", sub("r = 8", "r = 8, target_modules = []"),
     "stage[0].adapter.target_modules: list should have at least 1 item after validation, not 0 (got []) or input "
     "should be 'all-linear', 'attention' or 'mlp' (got [])"),
    ("encoding", "table-twice", append('\n[template]\nuse = "chatml"\n'),
     "invalid TOML: Cannot declare ('template',) twice (column 10)", 29),
    ("encoding", "unclosed-array", sub('tokenizer_data = ["train"]', 'tokenizer_data = ["train"'),
     "invalid TOML: Unclosed array (column 1)", 12),
    ("encoding", "broken-inline-table", sub('adapter = { use = "lora", r = 8 }', 'adapter = { use = "lora", r = 8'),
     "invalid TOML: Unclosed inline table (column 32)", 25),
    ("paths", "output-dir-is-a-file", sub('output_dir = "runs"', 'output_dir = "train.jsonl"'),
     "run.output_dir: {tmp}/train.jsonl is a file, not a folder; the run is written to {tmp}/train.jsonl/tiny/"),
    ("paths", "run-folder-is-a-file",
     lambda t: sub('output_dir = "runs"', 'output_dir = "."')(sub('name = "tiny"', 'name = "train.jsonl"')(t)),
     "run.name: {tmp}/train.jsonl is a file, not a folder; the run is written to {tmp}/train.jsonl/"),
    ("paths", "export-under-a-file", append('\n[[export]]\nuse = "merged"\npath = "train.jsonl/merged"\n'),
     "export[0].path: cannot write train.jsonl/merged: {tmp}/train.jsonl is a file, not a folder"),
    ("paths", "scratch-tokenizer-folder-missing",
     sub('tokenizer_data = ["train"]', 'tokenizer = "my-tokenizer"'),
     "model.tokenizer: no such file or folder: {tmp}/my-tokenizer (got 'my-tokenizer')"),
    ("paths", "data-glob-matches-nothing", sub('path = "train.jsonl"', 'path = "data/*.jsonl"'),
     "data.train.path: no file matches '{tmp}/data/*.jsonl' (got 'data/*.jsonl')"),
]

# Issue #30, section 1: what `validate` let through.
THREE_STAGES = lambda t: sub('adapter = { use = "lora", r = 8 }\n', "")(t) + "".join(  # noqa: E731
    f'\n[[stage]]\nname = "more{i}"\ntrainer = "sft"\ndata = "train"\n' for i in (1, 2))
VALIDATE += [
    ("types", "stage-written-as-a-table", sub("[[stage]]", "[stage]"),
     "stage: must be an array of tables: write each stage as [[stage]] (double brackets), not [stage]"),
    ("numbers", "seed-negative", sub("seed = 1", "seed = -1"),
     "run.seed: must be between 0 and 4294967295 (2**32 - 1), got -1"),
    ("numbers", "seed-too-large", sub("seed = 1", "seed = 4294967296"),
     "run.seed: must be between 0 and 4294967295 (2**32 - 1), got 4294967296"),
    # The top-level [adapter] is named where it is written, once, however many stages use it.
    ("names", "top-level-adapter-unknown-key",
     lambda t: sub("[template]", '[adapter]\nuse = "lora"\nlora_aplha = 16\n\n[template]')(THREE_STAGES(t)),
     "adapter.lora_aplha: unknown key for adapter 'lora'; did you mean 'lora_alpha'? Valid keys: bias, lora_alpha, "
     "lora_dropout, modules_to_save, r, target_modules, target_parameters, train_projector, train_template_tokens, use, use_rslora, "
     "vision_tower"),
    ("numbers", "top-level-adapter-r-zero",
     lambda t: sub("[template]", '[adapter]\nuse = "lora"\nr = 0\n\n[template]')(THREE_STAGES(t)),
     "adapter.r: input should be greater than 0 (got 0)"),
    ("model", "hidden-size-not-a-multiple-of-heads", sub("hidden_size = 32", "hidden_size = 33"),
     "model.hidden_size: 33 is not a multiple of num_heads (2), so the heads cannot share the width; use a multiple "
     "of 2, such as 32"),
    ("model", "kv-heads-not-dividing-heads", sub("num_heads = 2", "num_heads = 4\nnum_kv_heads = 3"),
     "model.num_kv_heads: 3 does not divide num_heads (4): each key/value head must serve the same number of query "
     "heads; use a divisor of 4, such as 2"),
    ("model", "heads-set-in-config", sub("vocab_size = 300", "vocab_size = 300\nconfig = { num_attention_heads = 5 }"),
     "model.hidden_size: 32 is not a multiple of config.num_attention_heads (5), so the heads cannot share the width; "
     "use a multiple of 5, such as 30"),
]

# Plans with an `hf` model, whose path options are checked as folders or hub ids.
HF = ("[model]\nuse = \"scratch\"\nhidden_size = 32\nnum_layers = 1\nnum_heads = 2\n"
      "tokenizer_data = [\"train\"]\nvocab_size = 300\n")
VALIDATE += [
    ("paths", "hf-model-folder-missing", sub(HF, '[model]\nuse = "hf"\npath = "./models/base"\n'),
     "model.path: no such folder: {tmp}/models/base (got './models/base')"),
    ("paths", "hf-tokenizer-folder-missing",
     sub(HF, '[model]\nuse = "hf"\npath = "."\ntokenizer = "tokenizer"\n'),
     "model.tokenizer: no such folder: {tmp}/tokenizer (a Hugging Face id is written org/name) (got 'tokenizer')"),
    ("paths", "hf-absolute-folder-missing", sub(HF, '[model]\nuse = "hf"\npath = "/nonexistent/ftcore/model"\n'),
     "model.path: no such folder: /nonexistent/ftcore/model (got '/nonexistent/ftcore/model')"),
    ("paths", "hf-id-invalid", sub(HF, '[model]\nuse = "hf"\npath = "org/my--model"\n'),
     "model.path: no such folder: {tmp}/org/my--model (nor a valid Hugging Face id) (got 'org/my--model')"),
]

# Cases only a run finds: the model's shapes (checked on the meta device before any weight is read, and
# before the run folder is made) and the data's rows. (class, id, mutation, extra files, line)
RUN = [
    ("model", "max-length-beyond-context",
     sub("epochs = 1", "epochs = 1\nmax_length = 4096"),
     {}, "{plan}: stage[0].max_length: 4096 is longer than the model's context of 512 tokens "
         "(max_position_embeddings); use at most 512"),
    ("model", "target-module-not-in-model", sub("r = 8", 'r = 8, target_modules = ["qkv_proj"]'),
     {}, "{plan}: stage[0].adapter.target_modules: 'qkv_proj' matches no module in this llama model; its "
         "linear layers are: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head"),
    ("model", "target-module-not-linear", sub("r = 8", 'r = 8, target_modules = ["input_layernorm"]'),
     {}, "{plan}: stage[0].adapter.target_modules: 'input_layernorm' names LlamaRMSNorm modules, not linear "
         "or embedding layers, in this llama model; its linear layers are: q_proj, k_proj, v_proj, o_proj, "
         "gate_proj, up_proj, down_proj, lm_head"),
    ("model", "evaluator-max-length-beyond-context", append(EVALUATE + "max_length = 100000\n"),
     {}, "{plan}: evaluate[0].max_length: 100000 is longer than the model's context of 512 tokens "
         "(max_position_embeddings); use at most 512"),
    ("data", "text-rows-for-sft", sub('path = "train.jsonl"', 'path = "text.jsonl"'),
     {"text.jsonl": '{"text": "the cat sees the dog."}\n{"text": "the dog sees the cat."}\n'},
     "error: data.train (text.jsonl): trainer 'sft' (stage sft) needs chat rows (messages, Alpaca, "
     "ShareGPT, ...) or prompt/completion rows; this data has text; for plain text use trainer = \"pretrain\""),
    ("data", "chat-without-assistant-turn", sub('path = "train.jsonl"', 'path = "asks.jsonl"'),
     {"asks.jsonl": '{"messages": [{"role": "user", "content": "Which is an animal? red cat tree"}]}\n'},
     "error: data.train (asks.jsonl), row 1: 'messages' has no assistant turn, so trainer 'sft' has nothing to "
     "train on (roles: user); add the answer, or set train_on_inputs = true to train on the whole conversation"),
    ("data", "malformed-json-line", sub('path = "train.jsonl"', 'path = "broken.jsonl"'),
     {"broken.jsonl": '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
                      '{"messages": [\n'},
     "error: data.train: broken.jsonl:2: invalid JSON: Expecting value (column 15)"),
    ("data", "unknown-role", sub('path = "train.jsonl"', 'path = "roles.jsonl"'),
     {"roles.jsonl": '{"messages": [{"role": "human", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'},
     "error: data.train: roles.jsonl:1: unknown role 'human' in 'messages[0].role' (expected one of: system, "
     "user, assistant, tool)"),
    ("data", "empty-file", sub('path = "train.jsonl"', 'path = "empty.jsonl"'), {"empty.jsonl": ""},
     "error: data.train: empty.jsonl: empty file"),
    ("data", "not-utf8", sub('path = "train.jsonl"', 'path = "latin1.jsonl"'),
     {"latin1.jsonl": '{"messages": [{"role": "user", "content": "caf\xe9"}, {"role": "assistant", '
                      '"content": "yo"}]}\n'.encode("latin-1")},
     "error: data.train: latin1.jsonl:1: not UTF-8 text (invalid continuation byte: byte 0xe9 at column 47); "
     "save the file as UTF-8"),
    ("data", "content-not-a-string", sub('path = "train.jsonl"', 'path = "typed.jsonl"'),
     {"typed.jsonl": '{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "yo"}]}\n'},
     "error: data.train: typed.jsonl:1: field 'messages[0].content' must be a string (or a list of text and image parts), "
     "got a number"),
    ("data", "preference-rows-for-sft-without-chosen", sub('path = "train.jsonl"', 'path = "pairs.jsonl"'),
     {"pairs.jsonl": '{"prompt": "Which is an animal?", "rejected": "the tree"}\n'},
     "error: data.train: pairs.jsonl:1: cannot tell the row's format from its fields (prompt, rejected); "),
    ("data", "dpo-pair-with-a-bad-field",
     lambda t: sub('trainer = "sft"', 'trainer = "dpo"')(sub('path = "train.jsonl"', 'path = "pairs.jsonl"')(t)),
     {"pairs.jsonl": '{"prompt": "Which is an animal? red cat tree", "chosen": "the cat", "rejected": "the tree"}\n'
                     '{"prompt": "Which is an animal? dog stone", "chosen": 3, "rejected": "the stone"}\n'},
     "error: data.train: pairs.jsonl:2: field 'chosen' must be a list of messages, got a number"),
    ("data", "second-user-turn", sub('path = "train.jsonl"', 'path = "twice.jsonl"'),
     {"twice.jsonl": '{"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}, '
                     '{"role": "assistant", "content": "yo"}]}\n'},
     "error: data.train: twice.jsonl:1: 'messages[1]' is a second user turn in a row; merge them into one "
     "message"),
]


# -- running the CLI: in this process, or for real ---------------------------------------------------------

# The cases that run `python -m ftcore` in a subprocess: one of each class of bad input (validate's and run's),
# and the cases whose environment variables huggingface_hub reads once, at import (HF_ENDPOINT, HF_HOME).
PROCESS = {
    # test_validate_refuses_with_one_line
    "epochs-inf", "unknown-template", "learning-rate-string", "duplicate-key", "output-dir-is-a-file",
    "hidden-size-not-a-multiple-of-heads",
    # test_run_refuses_with_one_line_and_leaves_nothing_in_the_way
    "max-length-beyond-context", "malformed-json-line",
    # test_model_problems_are_one_line_before_the_run_folder (validate, run, and the rerun)
    "hf-id-offline", "hf-id-hub-unreachable", "hf-tokenizer-id-hub-unreachable",
}


class Result(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


def _process(args: tuple[str, ...], env: dict[str, str]) -> Result:
    r = subprocess.run([sys.executable, "-m", "ftcore", *args], capture_output=True, text=True, timeout=3600,
                       env={**os.environ, **env})  # the timeout only catches a hang
    return Result(r.returncode, r.stdout, r.stderr)


def _in_process(args: tuple[str, ...], env: dict[str, str], monkeypatch, capfd) -> Result:
    """``python -m ftcore ARGS`` as ``ftcore/__main__.py`` runs it (``raise SystemExit(main())``), in this
    process: the exit status from ``main``'s return value or its SystemExit (argparse's), stdout and stderr
    as the file descriptors saw them. What the CLI changes in the process is put back afterwards, so that
    one case cannot change what the next sees."""
    import logging
    import signal
    import warnings

    from ftcore import cli

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    environ, cwd = dict(os.environ), os.getcwd()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    capturing = logging._warnings_showwarning is not None  # logging.captureWarnings(True) in effect
    signals = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    capfd.readouterr()  # what the test printed before is not the CLI's
    extra = ""
    try:
        with warnings.catch_warnings():
            try:
                code = cli.main(list(args))
            except SystemExit as exc:
                code = exc.code
        if code is None:
            code = 0
        elif not isinstance(code, int):  # SystemExit("message"): printed, exit status 1
            code, extra = 1, f"{code}\n"
    finally:
        out, err = capfd.readouterr()
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
        root.handlers[:] = handlers
        root.setLevel(level)
        logging.captureWarnings(capturing)
        for sig, handler in signals.items():
            signal.signal(sig, handler)
    return Result(code, out, err + extra)


@pytest.fixture
def cli(request, monkeypatch, capfd) -> Callable[..., Result]:
    """``cli(*args, env={})``: the CLI on ``args`` with third-party plugins off, in a subprocess for the cases
    in ``PROCESS``, in this process for the others."""
    callspec = getattr(request.node, "callspec", None)
    real = callspec is not None and callspec.id in PROCESS

    def run(*args: str, env: dict[str, str] | None = None) -> Result:
        env = {"FTCORE_LOAD_PLUGINS": "", **(env or {})}
        return _process(args, env) if real else _in_process(args, env, monkeypatch, capfd)

    return run


def test_every_class_runs_a_real_process():
    """A real ``python -m ftcore`` for every class of bad input that validate refuses, for every class that
    only a run finds, and in each test."""
    cases = {"validate": VALIDATE, "run": RUN, "model": MODEL}
    assert {c[0] for c in VALIDATE} == {c[0] for c in VALIDATE if c[1] in PROCESS}
    found_by_run = RUN + [c for c in MODEL if c[4] == "run"]
    assert {c[0] for c in found_by_run} == {c[0] for c in found_by_run if c[1] in PROCESS}
    for test, corpus in cases.items():
        assert any(c[1] in PROCESS for c in corpus), test
    assert PROCESS <= {c[1] for corpus in cases.values() for c in corpus}
    # An environment of its own is read by huggingface_hub when it is imported: only a process of its own sees it.
    assert {c[1] for c in MODEL if c[5]} <= PROCESS


def _expected(line: str, plan: Path) -> str:
    return line.format(tmp=plan.parent.resolve(), plan=plan)


def _one_line(result, plan: Path) -> str:
    assert result.returncode == 2, (result.returncode, result.stdout[-2000:], result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def _no_blocking_run_folder(folder: Path) -> None:
    for run in (folder / "runs").glob("*") if (folder / "runs").exists() else []:
        manifest = rundir.read_json(run / rundir.MANIFEST) or {}
        assert manifest.get("status") == "failed" and not rundir.trained_anything(run), (run, manifest)


def _outside_runs(snap: dict) -> dict:
    return {k: v for k, v in snap.items() if not k.startswith("runs")}


@pytest.mark.parametrize("cls, mutate, line, at", [(*c[:1], *c[2:4], c[4] if len(c) > 4 else None) for c in VALIDATE],
                         ids=[c[1] for c in VALIDATE])
def test_validate_refuses_with_one_line(tmp_path, cli, cls, mutate, line, at):
    plan = write_project(tmp_path, mutate(BASE))
    before = snapshot(tmp_path)
    got = _one_line(cli("validate", str(plan)), plan)
    want = f"{plan}{f':{at}' if at else ''}: {_expected(line, plan)}"
    assert (got.startswith(want) if want.endswith("Available: ") else got == want), (got, want)
    assert snapshot(tmp_path) == before


@pytest.mark.slow
@pytest.mark.parametrize("cls, mutate, files, line", [(c[0], c[2], c[3], c[4]) for c in RUN],
                         ids=[c[1] for c in RUN])
def test_run_refuses_with_one_line_and_leaves_nothing_in_the_way(tmp_path, cli, cls, mutate, files, line):
    plan = write_project(tmp_path, mutate(BASE))
    for name, content in files.items():
        path = tmp_path / name
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content, encoding="utf-8")
    before = _outside_runs(snapshot(tmp_path))
    got = _one_line(cli("run", str(plan)), plan)
    want = _expected(line, plan)
    assert (got.startswith(want) if want.endswith("; ") else got == want), (got, want)
    assert _outside_runs(snapshot(tmp_path)) == before
    if cls == "model":  # checked before the run folder is made
        assert not (tmp_path / "runs").exists()
    _no_blocking_run_folder(tmp_path)


def test_the_corpus_covers_every_class():
    counts = Counter([CLASS_OF[c[0]] for c in CASES] + [c[0] for c in VALIDATE] + [c[0] for c in RUN]
                     + [c[0] for c in MODEL])
    print("\n" + "\n".join(f"{cls:>10}: {counts[cls]:3d}  {what}" for cls, what in CLASSES.items()))
    print(f"{'total':>10}: {sum(counts.values()):3d}")
    assert set(CLASS_OF) == {c[0] for c in CASES}
    assert set(counts) == set(CLASSES) and min(counts.values()) >= 3
    assert sum(counts.values()) >= 80


# -- issue #30, section 1: model, tokenizer, adapter and hub problems, one line each ----------------------
#
# Each case is a plan (BASE with its [model] replaced, or mutated), the files it needs beside it, and the
# line: validate refuses it ("validate": so does run, with the same line) or only a run's preflight can
# (it needs transformers: "run"); either way before the run folder exists. "…" in a line stands for text
# that transformers, the network or a file size words. Each is then run again, without flags, and meets
# the same line: nothing the first attempt left is in the way.

def _hf(model: str) -> Callable[[str], str]:
    return sub(HF, "[model]\nuse = \"hf\"\n" + model)


def _config(**fields: Any) -> Callable[[Path], None]:
    def change(folder: Path) -> None:
        path = folder / "base" / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return change


def _truncate(name: str) -> Callable[[Path], None]:
    def change(folder: Path) -> None:
        path = folder / "base" / name
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return change


def _remove(*names: str) -> Callable[[Path], None]:
    def change(folder: Path) -> None:
        for name in names:
            (folder / "base" / name).unlink()
    return change


def _folder(name: str, *files: str) -> Callable[[Path], None]:
    def change(folder: Path) -> None:
        (folder / name).mkdir()
        for file in files:
            (folder / name / file).write_text("notes\n")
    return change


def _corrupt_tokenizer(folder: Path) -> None:
    shutil.copytree(folder / "base", folder / "tok")
    path = folder / "tok" / "tokenizer.json"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _none(folder: Path) -> None:
    pass


LORA = 'adapter = { use = "lora", r = 8 }'
UNREACHABLE = {"HF_ENDPOINT": "http://127.0.0.1:9"}  # port 9 (discard): refused at once, whatever the network

# (class, id, plan mutation, files, where it is refused, extra environment, line after "<plan>: ")
MODEL = [
    ("model", "hf-model-folder-empty", _hf('path = "empty"\ntokenizer = "base"\n'), _folder("empty"), "validate", {},
     "model.path: {tmp}/empty is an empty folder, not a model (no config.json, no weights)"),
    ("model", "hf-model-folder-without-config", _hf('path = "notes"\ntokenizer = "base"\n'),
     _folder("notes", "README.md"), "validate", {},
     "model.path: {tmp}/notes holds no config.json, so it is not a transformers model folder"),
    ("model", "hf-tokenizer-folder-empty", _hf('path = "base"\ntokenizer = "tok"\n'), _folder("tok"), "validate", {},
     "model.tokenizer: {tmp}/tok is an empty folder (no tokenizer.json, tokenizer_config.json, tokenizer.model, "
     "vocab.json, ...)"),
    ("model", "hf-tokenizer-path-is-a-file", _hf('path = "base"\ntokenizer = "base/tokenizer.json"\n'), _none,
     "validate", {}, "model.tokenizer: {tmp}/base/tokenizer.json is a file, not a tokenizer folder (point to the "
                     "folder that holds it)"),
    ("model", "hf-hidden-size-not-a-multiple-of-heads", _hf('path = "base"\n'),
     _config(num_attention_heads=3, head_dim=None), "validate", {},
     "model.path: {tmp}/base/config.json: hidden_size 32 is not a multiple of num_attention_heads 3, and no head_dim "
     "is set: the heads cannot share the width"),
    # The same edit where config.json keeps its head_dim (as transformers writes it): transformers refuses it.
    ("model", "hf-hidden-size-not-a-multiple-of-heads-with-head-dim", _hf('path = "base"\n'),
     _config(num_attention_heads=3), "run", {},
     "model.path: {tmp}/base/config.json: transformers cannot build this model: …32…3…"),
    # Heads that divide, but not the ones the weights were saved with.
    ("model", "hf-config-does-not-match-the-weights", _hf('path = "base"\n'), _config(num_attention_heads=4),
     "run", {}, "model.path: {tmp}/base/config.json does not match the weights: model.layers.0.self_attn.q_proj.weight "
                "is [32, 32] in model.safetensors, [64, 32] by the config"),
    ("model", "hf-kv-heads-not-dividing-heads", _hf('path = "base"\n'),
     _config(num_attention_heads=4, num_key_value_heads=3), "validate", {},
     "model.path: {tmp}/base/config.json: num_key_value_heads 3 does not divide num_attention_heads 4: each key/value "
     "head must serve the same number of query heads"),
    ("model", "hf-truncated-safetensors", _hf('path = "base"\n'), _truncate("model.safetensors"), "validate", {},
     "model.path: {tmp}/base/model.safetensors is truncated: … of its … bytes; copy or download it again"),
    ("model", "hf-unknown-model-type", _hf('path = "base"\n'), _config(model_type="lama"), "run", {},
     "model.path: {tmp}/base/config.json: unknown model type 'lama' (transformers … does not know it; a newer one "
     "may); did you mean 'llama'?"),
    ("model", "hf-corrupt-tokenizer-json", _hf('path = "base"\ntokenizer = "tok"\n'), _corrupt_tokenizer, "run", {},
     "model.tokenizer: {tmp}/tok/tokenizer.json cannot be read: …"),
    ("model", "hf-folder-without-weights", _hf('path = "base"\n'), _remove("model.safetensors"), "run", {},
     "model.path: {tmp}/base has a config.json but no weights (*.safetensors or pytorch_model.bin)"),
    ("model", "hf-folder-without-tokenizer", _hf('path = "base"\n'), _remove("tokenizer.json", "tokenizer_config.json"),
     "run", {}, "model.path: {tmp}/base holds no tokenizer (no tokenizer.json, tokenizer_config.json, tokenizer.model, "
                "vocab.json, ...); set model.tokenizer to the tokenizer's folder or hub id"),
    ("paths", "hf-local-looking-id", _hf('path = "models/base"\n'), _folder("models"), "validate", {},
     "model.path: no such folder: {tmp}/models/base (there is a folder {tmp}/models, so this is not read as a "
     "Hugging Face id) (got 'models/base')"),
    ("paths", "hf-id-offline", _hf('path = "models/base"\n'), _none, "validate", {"HF_HUB_OFFLINE": "1"},
     "model.path: no such folder: {tmp}/models/base (nor a model in the Hugging Face cache, and HF_HUB_OFFLINE is "
     "set) (got 'models/base')"),
    ("paths", "hf-id-hub-unreachable", _hf('path = "models/base"\n'), _none, "run", UNREACHABLE,
     "model.path: no such folder: {tmp}/models/base, and the Hugging Face hub (http://127.0.0.1:9) cannot be reached "
     "to fetch 'models/base' (…); download it where the hub is reachable, or name a local folder"),
    ("paths", "hf-tokenizer-id-hub-unreachable", _hf('path = "base"\ntokenizer = "org/tokenizer"\n'), _none, "run",
     UNREACHABLE, "model.tokenizer: no such folder: {tmp}/org/tokenizer, and the Hugging Face hub "
                  "(http://127.0.0.1:9) cannot be reached to fetch 'org/tokenizer' (…); download it where the hub is "
                  "reachable, or name a local folder"),
    ("model", "scratch-unknown-architecture", sub("num_layers = 1", 'num_layers = 1\narchitecture = "lama"'), _none,
     "run", {}, "model.architecture: unknown architecture 'lama' (transformers … does not know it; a newer one may); "
                "did you mean 'llama'?"),
    ("model", "scratch-odd-head-size", sub("hidden_size = 32", "hidden_size = 30"), _none, "run", {},
     "model.hidden_size: transformers cannot build this llama model: …head_dim…"),
    ("model", "lora-r-beyond-the-model", sub(LORA, 'adapter = { use = "lora", r = 100000 }'), _none, "run", {},
     "stage[0].adapter.r: 100000 is more than the smaller dimension of the targeted layers (q_proj: 32 x 32), beyond "
     "which a rank adds parameters but no capacity; use at most 32, or full fine-tuning (adapter = \"full\")"),
    ("model", "top-level-adapter-r-beyond-the-model",
     lambda t: sub("[template]", '[adapter]\nuse = "lora"\nr = 64\n\n[template]')(THREE_STAGES(t)), _none, "run", {},
     "adapter.r: 64 is more than the smaller dimension of the targeted layers (q_proj: 32 x 32), beyond which a rank "
     "adds parameters but no capacity; use at most 32, or full fine-tuning (adapter = \"full\")"),
    ("model", "modules-to-save-not-in-model", sub(LORA, 'adapter = { use = "lora", r = 8, modules_to_save = '
                                                        '["score_head"] }'), _none, "run", {},
     "stage[0].adapter.modules_to_save: 'score_head' matches no module in this llama model; its modules are named: "
     "act_fn, down_proj, embed_tokens, …, v_proj"),
    ("model", "ia3-modules-to-save-not-in-model", sub(LORA, 'adapter = { use = "ia3", modules_to_save = ["lm_haed"] }'),
     _none, "run", {}, "stage[0].adapter.modules_to_save: 'lm_haed' matches no module in this llama model; did you "
                       "mean 'lm_head'?; its modules are named: …"),
]


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    """A 1-layer llama (hidden 32, 2 heads, 1 key/value head) with a byte-level BPE tokenizer trained on the
    base plan's rows, saved as a transformers folder."""
    pytest.importorskip("torch")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator([m["content"] for row in ROWS for m in row["messages"]],
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    config = AutoConfig.for_model("llama", vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
                                  max_position_embeddings=128)
    folder = tmp_path_factory.mktemp("tiny-hf") / "base"
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _matches(line: str, want: str) -> bool:
    return re.fullmatch(".*".join(re.escape(part) for part in want.split("…")), line, re.S) is not None


@pytest.mark.slow
@pytest.mark.parametrize("cls, mutate, files, where, env, line", [c[:1] + c[2:] for c in MODEL],
                         ids=[c[1] for c in MODEL])
def test_model_problems_are_one_line_before_the_run_folder(tmp_path, tiny_hf, cli, cls, mutate, files, where, env,
                                                           line):
    plan = write_project(tmp_path, mutate(BASE))
    if "base" in plan.read_text():
        shutil.copytree(tiny_hf, tmp_path / "base")
    files(tmp_path)
    env = {"HF_HOME": str(tmp_path.parent / f"{tmp_path.name}-hf-home"), **env}  # an empty hub cache (a process's)
    want = f"{plan}: {_expected(line, plan)}"
    before = snapshot(tmp_path)
    validated = cli("validate", str(plan), env=env)
    if where == "validate":
        assert _matches(_one_line(validated, plan), want), (validated.stderr, want)
    else:
        assert validated.returncode == 0, validated.stderr
    started = time.monotonic()
    got = _one_line(cli("run", str(plan), env=env), plan)
    assert _matches(got, want), (got, want)
    assert len(got) < 600, got  # no list of every model type transformers knows
    assert time.monotonic() - started < 120  # no retries against a hub that is not there
    assert not (tmp_path / "runs").exists() and snapshot(tmp_path) == before
    # A rerun without flags meets the same line: the first left nothing in the way.
    assert _one_line(cli("run", str(plan), env=env), plan) == got


@pytest.mark.slow
def test_a_run_that_trained_nothing_reruns_without_flags(tmp_path):
    """A run that failed before its first training step (its step-0 records: the loss kernel, the trainable
    parameters) holds nothing to keep: the next `ftcore run`, of this plan or a changed one, starts over
    without --force or --resume."""
    plan = write_project(tmp_path, sub("epochs = 1", "max_steps = 1")(BASE))
    run = tmp_path / "runs" / "tiny"
    (run / "stages" / "sft" / "checkpoints").mkdir(parents=True)
    rundir.write_json(run / rundir.MANIFEST, {"status": "failed", "plan_fingerprint": "another plan",
                                              "plan_path": str(plan), "error": "Seed must be between 0 and 2**32 - 1"})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"stage": "memory", "step": None, "baseline/rss_mib": 500.0},
        {"stage": "sft", "step": 0, "loss_kernel": "chunked"},
        {"stage": "sft", "step": 0, "trainable_params": 5888, "total_params": 31808}]))
    assert not rundir.trained_anything(run)
    result = _process(("run", str(plan)), {"FTCORE_LOAD_PLUGINS": ""})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "the previous run here failed before training" in result.stdout
    assert rundir.read_json(run / rundir.MANIFEST)["status"] == "complete"
    # A step 1 is training: that run is kept, and a changed plan is refused there.
    assert rundir.trained_anything(run)


def test_step_zero_bookkeeping_is_not_training(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"stage": "sft", "step": 0, "loss_kernel": "chunked"}) + "\n")
    assert not rundir.trained_anything(tmp_path)
    with (tmp_path / "metrics.jsonl").open("a") as fh:
        fh.write(json.dumps({"stage": "sft", "step": 1, "loss": 2.5}) + "\n")
    assert rundir.trained_anything(tmp_path)
    rundir.write_json(tmp_path / rundir.MANIFEST, {"status": "failed", "plan_fingerprint": "a"})
    with pytest.raises(rundir.FtcoreError, match="holds a run of a different plan"):
        rundir.prepare(tmp_path, "b", resume=False, force=False)


# -- the command line itself -----------------------------------------------------------------------------

def _main(monkeypatch, capsys, raised: BaseException, argv: list[str]) -> tuple[int, list[str]]:
    from ftcore import cli

    def command(args):
        raise raised

    monkeypatch.setattr(cli, "cmd_run", command)
    monkeypatch.setenv("FTCORE_LOAD_PLUGINS", "")
    code = cli.main(argv)
    return code, capsys.readouterr().err.splitlines()


def test_a_plugin_failure_is_one_line(monkeypatch, capsys):
    from ftcore.errors import ComponentError

    failure = ComponentError("evaluator 'crash' from plugin 'crash' (crash-evals 1.0) failed in evaluate() "
                             "[evaluation 'crash', evaluate[0]]: ValueError: bad thing happened")
    code, lines = _main(monkeypatch, capsys, failure, ["run", "plan.toml"])
    assert code == 1 and lines == [f"error: {failure} (run with --debug for the traceback)"]
    code, lines = _main(monkeypatch, capsys, failure, ["run", "--debug", "plan.toml"])
    assert code == 1 and lines[0] == f"error: {failure}" and "Traceback (most recent call last):" in lines


def test_an_interrupted_run_names_its_plan(monkeypatch, capsys):
    from ftcore.errors import Interrupted

    code, lines = _main(monkeypatch, capsys, KeyboardInterrupt(), ["run", "my plans/a.toml"])
    assert code == 130 and lines == ["interrupted; continue with: ftcore run 'my plans/a.toml' --resume"]
    # A second Ctrl-C in a stage that did not know the plan's path: the CLI names it.
    again = Interrupted("stage sft: SIGINT again: stopped at once, without a checkpoint; no checkpoint was saved yet; "
                        "resume with: ftcore run <plan> --resume", 130)
    code, lines = _main(monkeypatch, capsys, again, ["run", "plan.toml"])
    assert code == 130 and lines == ["stage sft: SIGINT again: stopped at once, without a checkpoint; no checkpoint "
                                     "was saved yet; resume with: ftcore run plan.toml --resume"]


def test_python_m_ftcore_cli_prints_its_help():
    result = subprocess.run([sys.executable, "-m", "ftcore.cli", "--help"], capture_output=True, text=True,
                            timeout=600, env={**os.environ, "FTCORE_LOAD_PLUGINS": ""})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: ftcore") and "validate" in result.stdout
    assert result.stderr == ""


def test_an_adapter_larger_than_the_model_is_warned():
    """r within every targeted layer's dimensions, but an adapter with more parameters than the model."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    from ftcore.context import AdapterContext
    from ftcore.plugins import get_plugin_manager

    class Kept:
        def __init__(self):
            self.warnings: list[str] = []

        def info(self, message):
            pass

        def warn(self, message):
            self.warnings.append(message)

    config = AutoConfig.for_model("llama", vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=2)
    torch.manual_seed(0)
    reg = get_plugin_manager(entry_points=False).registry().resolve("adapter", "lora")
    warned = {}
    for r in (16, 4):
        reporter = Kept()
        model = AutoModelForCausalLM.from_config(config)
        reg.cls(reg.cls.Options(r=r)).apply(model, AdapterContext(None, reporter, None))
        warned[r] = reporter.warnings
    assert warned[4] == [], warned
    assert len(warned[16]) == 1 and warned[16][0].startswith("adapter lora (r=16) trains ") \
        and "parameters, more than the model's own " in warned[16][0], warned
