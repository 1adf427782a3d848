"""The bad-input corpus: malformed plans and data files, each refused with one line before work starts.

Every case breaks the small valid project of ``test_plan_errors`` in one way and runs the real CLI in
a subprocess. Each must exit with status 2, print exactly one line on stderr (no traceback) naming the
plan or data file and the key, line or row, leave every file outside ``runs/`` as it was, and leave no
run folder that would stop the next ``ftcore run`` (none at all, or one that failed before training,
which the next run replaces).

The plan cases of ``test_plan_errors.CASES`` belong to the corpus too; ``CLASS_OF`` sorts them into
the classes below, and ``test_the_corpus_covers_every_class`` counts them.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from test_plan_errors import BASE, CASES, EVALUATE, append, ftcore, snapshot, sub, write_project

from ftcore import rundir

CLASSES = {
    "encoding": "the plan file itself: TOML syntax, encoding, a missing file",
    "names": "unknown keys, components and tables, with a suggestion",
    "types": "a value of the wrong type",
    "numbers": "numbers out of bounds: inf, nan, zero, negative, too large",
    "references": "names of data, stages, phases and requirements that do not resolve",
    "paths": "paths that do not exist, or that a file stands in the way of",
    "model": "what only the model's shapes decide: context length, target modules (checked on the meta model)",
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
     "error: data.train: typed.jsonl:1: field 'messages[0].content' must be a string (or a list of text parts), "
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
def test_validate_refuses_with_one_line(tmp_path, cls, mutate, line, at):
    plan = write_project(tmp_path, mutate(BASE))
    before = snapshot(tmp_path)
    got = _one_line(ftcore("validate", str(plan)), plan)
    want = f"{plan}{f':{at}' if at else ''}: {_expected(line, plan)}"
    assert (got.startswith(want) if want.endswith("Available: ") else got == want), (got, want)
    assert snapshot(tmp_path) == before


@pytest.mark.slow
@pytest.mark.parametrize("cls, mutate, files, line", [(c[0], c[2], c[3], c[4]) for c in RUN],
                         ids=[c[1] for c in RUN])
def test_run_refuses_with_one_line_and_leaves_nothing_in_the_way(tmp_path, cls, mutate, files, line):
    plan = write_project(tmp_path, mutate(BASE))
    for name, content in files.items():
        path = tmp_path / name
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content, encoding="utf-8")
    before = _outside_runs(snapshot(tmp_path))
    got = _one_line(ftcore("run", str(plan)), plan)
    want = _expected(line, plan)
    assert (got.startswith(want) if want.endswith("; ") else got == want), (got, want)
    assert _outside_runs(snapshot(tmp_path)) == before
    if cls == "model":  # checked before the run folder is made
        assert not (tmp_path / "runs").exists()
    _no_blocking_run_folder(tmp_path)


def test_the_corpus_covers_every_class():
    counts = Counter([CLASS_OF[c[0]] for c in CASES] + [c[0] for c in VALIDATE] + [c[0] for c in RUN])
    print("\n" + "\n".join(f"{cls:>10}: {counts[cls]:3d}  {what}" for cls, what in CLASSES.items()))
    print(f"{'total':>10}: {sum(counts.values()):3d}")
    assert set(CLASS_OF) == {c[0] for c in CASES}
    assert set(counts) == set(CLASSES) and min(counts.values()) >= 3
    assert sum(counts.values()) >= 80
