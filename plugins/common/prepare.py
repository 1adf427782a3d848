"""Tokenized datasets for trainers and evaluators: masked, length-limited, cached on disk.

The cache key covers everything that changes the result: the rows' content, the
tokenizer (vocabulary, merges, special tokens, chat template), the chat template
component (name, options and what it renders for a probe conversation), every
tokenization option, and ``DATA_LAYER_VERSION``. Entries live in
``ftcore_plugins.common.cache.cache_dir()/tokenized``, outside any run directory.

Preparation streams: the rows are tokenized a batch at a time and written to Arrow shards of
``SHARD_ROWS`` rows as they go, so the tokenized set is never held in memory, and the entry is the
shards, memory-mapped when loaded. A shard is finished when its ``.json`` is written; a
preparation that was killed resumes from the finished shards (they sit in ``.<key>.partial`` next
to where the entry will be, and become the entry when the last one is done). One process prepares
an entry at a time (a lock file); another waits for it and then reads the entry.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import random
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ftcore.errors import FtcoreError
from ftcore_plugins.common.cache import cache_dir
from ftcore_plugins.common.memory import MappedPages

from ftcore_plugins.common.chat import Truncation, encode

DATA_LAYER_VERSION = 5  # bump when tokenization, masking or the entry's layout changes
SHARD_ROWS = 50_000  # rows per shard: what an interrupted preparation resumes from
# Rows per Arrow record batch of the files ftcore writes or has datasets write. Opening a file
# reads every batch's header, and the kernel maps 64 KB of the file around each: at datasets'
# default of 1,000 rows that is ~64 MB resident per million rows, at once, before any pass.
ARROW_BATCH_ROWS = 10_000
ARROW_BATCH_BYTES = 64 * 2**20  # and no more than this in memory at a time (long documents)
# The resident pages of memory-mapped Arrow files (datasets' cache and ftcore's): the passes over
# them (the content hash, tokenization, the sources' reading and filters) check it between batches.
ARROW_PAGES = MappedPages(lambda path: path.endswith(".arrow"))
SHARD_NAME = re.compile(r"\d{5}\.arrow")
COUNTS = ("rows", "samples", "kept", "truncated", "dropped_too_long", "dropped_no_labels", "skipped_unrenderable",
          "tokens", "label_tokens", "end_token_added", "reasoning_dropped")

_PROBE = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U1"},
    {"role": "assistant", "content": "A1"},
    {"role": "user", "content": "U2 with\nnewline"},
    {"role": "assistant", "content": " A2 "},
]


@dataclass
class Prepared:
    dataset: Any  # datasets.Dataset with input_ids and labels
    stats: dict[str, Any]
    cache_hit: bool
    key: str


def data_fingerprint(rows: Any) -> str:
    """Hash of a dataset's content (its Arrow data, batch by batch)."""
    import pyarrow as pa

    h = hashlib.sha256()
    h.update(json.dumps(sorted(rows.column_names)).encode())
    for table in rows.with_format("arrow").iter(batch_size=ARROW_BATCH_ROWS):
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        h.update(sink.getvalue())
        ARROW_PAGES.check()
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """The vocabulary, merges and rules, the added and special tokens, and the chat template.

    The serialised tokenizer is the ground truth; its JSON is rebuilt from memory, so
    changes made after loading (added tokens, a new template) count."""
    h = hashlib.blake2b(digest_size=32)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update((backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items())))
             .encode())
    h.update(json.dumps({"special": tokenizer.special_tokens_map, "eos": tokenizer.eos_token,
                         "pad": tokenizer.pad_token, "chat_template": getattr(tokenizer, "chat_template", None)},
                        sort_keys=True, default=str).encode())
    return h.hexdigest()


def template_fingerprint(template: Any, tokenizer: Any) -> str:
    """Name, options, and what the template renders: a code change that alters the text misses."""
    parts = [type(template).__module__, type(template).__qualname__, getattr(template, "name", "")]
    options = getattr(template, "options", None)
    parts.append(options.model_dump_json() if hasattr(options, "model_dump_json") else repr(options))
    for messages, gen in ((_PROBE, False), (_PROBE[:4], True), (_PROBE[1:], False)):
        try:
            parts.append(template.render(messages, tokenizer, add_generation_prompt=gen))
        except Exception as exc:  # e.g. a family that rejects the system role
            parts.append(f"{type(exc).__name__}: {exc}")
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()


def prepare(rows: Any, tokenizer: Any, template: Any, *, max_length: int | None,
            truncation: Truncation = "truncate_response", train_on_inputs: bool = False,
            add_eos_to_text: bool = True, reporter: Any = None, description: str = "tokenize",
            use_cache: bool = True, on_error: str = "error", where: str = "data", seq2seq: bool = False) -> Prepared:
    """The rows tokenized and masked (cached); what the template could not do for them is warned
    about once, with the counts (cached entries too): see :func:`template_notes`. ``seq2seq``: for an
    encoder-decoder model, the prompt as ``input_ids`` and the answer as ``labels`` (``common/seq2seq.py``)."""
    refuse_images(rows, where)
    prepared = _prepare(rows, tokenizer, template, max_length=max_length, truncation=truncation,
                        train_on_inputs=train_on_inputs, add_eos_to_text=add_eos_to_text, reporter=reporter,
                        description=description, use_cache=use_cache, on_error=on_error, where=where,
                        seq2seq=seq2seq)
    if reporter is not None:
        for note in template_notes(prepared.stats, template, tokenizer):
            reporter.warn(f"{where}: {note}")
    return prepared


def template_notes(stats: dict, template: Any, tokenizer: Any) -> list[str]:
    """One line for each thing the rows needed that the template does not do: turns it leaves
    unclosed (the end-of-turn token added), reasoning it does not render (``dropped_reasoning = "warn"``)."""
    from ftcore_plugins.common.spans import SpanLocator, template_title

    notes, title = [], template_title(template)
    if stats.get("end_token_added"):
        token = SpanLocator(template, tokenizer).closing_token()
        declared = [str(t) for t in getattr(template, "stop_tokens", ()) or ()]
        notes.append(f"{title} renders no end-of-turn token after a conversation's last turn; {token!r} was added "
                     f"after {stats['end_token_added']:,} such turn(s) and trained, so that the model learns to stop"
                     + ("" if token in declared else f"; declare it with [template] stop_tokens = [{token!r}] so that "
                        "generation stops there too"))
    if stats.get("reasoning_dropped"):
        notes.append(f"{title} does not render reasoning_content: {stats['reasoning_dropped']:,} assistant turn(s) "
                     "are trained without their reasoning (dropped_reasoning = \"warn\"); use a template that renders "
                     "it (e.g. \"native\" with a reasoning model) to train it")
    return notes


def _prepare(rows: Any, tokenizer: Any, template: Any, *, max_length: int | None,
             truncation: Truncation = "truncate_response", train_on_inputs: bool = False,
             add_eos_to_text: bool = True, reporter: Any = None, description: str = "tokenize",
             use_cache: bool = True, on_error: str = "error", where: str = "data", seq2seq: bool = False) -> Prepared:
    quiet_library_progress_bars()
    options = {"max_length": max_length, "truncation": truncation, "train_on_inputs": train_on_inputs,
               "add_eos_to_text": add_eos_to_text, "on_error": on_error}
    if seq2seq:  # only then, so that the causal entries' keys stay as they were
        options["seq2seq"] = True
    key = hashlib.sha256(json.dumps({
        "version": DATA_LAYER_VERSION, "data": data_fingerprint(rows), "tokenizer": tokenizer_fingerprint(tokenizer),
        "template": template_fingerprint(template, tokenizer), "options": options}, sort_keys=True).encode()
    ).hexdigest()
    encoding = dict(tokenizer=tokenizer, template=template, max_length=max_length, truncation=truncation,
                    train_on_inputs=train_on_inputs, add_eos_to_text=add_eos_to_text, on_error=on_error,
                    where=where, seq2seq=seq2seq)
    if not use_cache:
        with tempfile.TemporaryDirectory(prefix="ftcore-tokenize-") as work:
            stats = encode_shards(rows, Path(work), encoding, reporter, description)
            return Prepared(load_shards(Path(work), in_memory=True), stats, False, key)
    folder = cache_dir() / "tokenized" / key[:2] / key
    entry = load_entry(folder)
    if entry is not None:
        return Prepared(*entry, True, key)
    with prepared_alone(folder):
        entry = load_entry(folder)  # prepared by another process while this one waited
        if entry is not None:
            return Prepared(*entry, True, key)
        work = folder.with_name(f".{key}.partial")
        stats = encode_shards(rows, work, encoding, reporter, description)
        (work / "stats.json").write_text(json.dumps(stats))
        if folder.exists():  # a damaged entry (load_entry said so): replaced, under the lock
            shutil.rmtree(folder)
        os.replace(work, folder)
    return Prepared(load_shards(folder), stats, False, key)


def data_origin(ctx: Any, label: str) -> tuple[str, str]:
    """For the stage's ``train`` or ``eval`` rows: how messages name them ("data.chat (chat.jsonl)")
    and the source's ``on_error``."""
    plan = getattr(getattr(ctx, "run", None), "plan", None)
    stage = next((s for s in plan.stages if s.name == ctx.stage), None) if plan is not None else None
    ref = (stage.data if label == "train" else (stage.eval_data or stage.data)) if stage else None
    selected = plan.data.get(str(ref).split(":")[0]) if ref else None
    if selected is None:
        return f"stage {ctx.stage} {label} data", "error"
    # The path as the plan writes it (relative to the plan's folder), as the data sources name it.
    written = ((plan.raw.get("data") or {}).get(selected.key.partition(".")[2]) or {}).get("path")
    path = written or getattr(selected.options, "path", None)
    paths = path if isinstance(path, (list, tuple)) else [path] if path else []
    shown = f"{selected.key} ({', '.join(str(p) for p in paths)})" if paths else selected.key
    return shown, getattr(selected.options, "on_error", "error")


def is_stream(rows: Any) -> bool:
    """A 🤗 ``IterableDataset`` (a source with ``streaming = true``)."""
    import datasets

    return isinstance(rows, datasets.IterableDataset)


def refuse_images(rows: Any, where: str) -> None:
    """Rows with images are made into batches by the vision path (common/vision.py); tokenized here as
    text, their images would be dropped without a word: one line instead."""
    if "images" in (getattr(rows, "column_names", None) or []):
        raise FtcoreError(f"{where}: the rows hold images, which this stage or evaluator does not take yet (trainer "
                          "sft does; docs/vision.md)")


def stream_tokenized(rows: Any, tokenizer: Any, template: Any, **encoding: Any) -> Any:
    """Streamed rows tokenized as training reads them, a batch at a time, as :func:`prepare` does
    (the same ``encode``): nothing is cached, and nothing but the batch is held."""
    def batch(columns: dict[str, list], indices: list[int]) -> dict[str, list]:
        chunk = [dict(zip(columns, values)) for values in zip(*columns.values())]
        out, _ = encode(chunk, tokenizer, template, first_row=indices[0] if indices else 0, **encoding)
        return out

    return rows.map(batch, batched=True, batch_size=1000, with_indices=True, remove_columns=list(rows.column_names),
                    features=tokenized_features())


def load_entry(folder: Path) -> tuple[Any, dict] | None:
    """A finished cache entry's dataset (memory-mapped) and stats, or None (absent or damaged)."""
    if not (folder / "stats.json").exists():
        return None
    try:
        return load_shards(folder), json.loads((folder / "stats.json").read_text())
    except (OSError, ValueError):
        return None  # a damaged entry: prepared again


@contextlib.contextmanager
def prepared_alone(folder: Path) -> Iterator[None]:
    """Hold the entry's lock file while preparing it (an advisory lock, released if the process dies)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(f".{folder.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def encode_shards(rows: Any, work: Path, encoding: dict, reporter: Any, description: str) -> dict:
    """Tokenize ``rows`` into Arrow shards in ``work`` (``00000.arrow``, ...), skipping the shards a
    killed preparation finished; returns the whole data's stats."""
    import numpy as np
    import pyarrow as pa
    from datasets.arrow_writer import ArrowWriter

    work.mkdir(parents=True, exist_ok=True)
    features = tokenized_features()
    total, shards = len(rows), max(1, -(-len(rows) // SHARD_ROWS))
    with (reporter.progress(description, total) if reporter else contextlib.nullcontext()) as bar:
        for shard in range(shards):
            done, first = work / f"{shard:05d}.json", shard * SHARD_ROWS
            part = range(first, min(total, first + SHARD_ROWS))
            if done.exists():
                if bar is not None:
                    bar.advance(len(part))
                continue
            written = work / f"{shard:05d}.arrow.tmp"
            with ArrowWriter(features=features, path=str(written), writer_batch_size=ARROW_BATCH_ROWS) as writer:
                pending: list = []

                def flush() -> None:
                    if pending:
                        writer.write_table(pa.concat_tables(pending))
                        pending.clear()

                def sink(columns: dict[str, list]) -> None:
                    ARROW_PAGES.check()
                    pending.append(arrow_columns(columns))
                    if (sum(t.num_rows for t in pending) >= ARROW_BATCH_ROWS
                            or sum(t.nbytes for t in pending) >= ARROW_BATCH_BYTES):
                        flush()

                _, stats = encode(rows.select(part) if hasattr(rows, "select") else rows[first:part.stop],
                                  progress=bar, first_row=first, sink=sink, **encoding)
                flush()
                writer.finalize()
            os.replace(written, work / f"{shard:05d}.arrow")
            np.save(work / f"{shard:05d}.lengths.npy", np.asarray(stats.lengths, dtype=np.int32))
            done.write_text(json.dumps({k: getattr(stats, k) for k in COUNTS}))  # last: the shard is finished
    return merged_stats(work, shards)


def arrow_columns(columns: dict[str, list]) -> Any:
    """A batch of ``encode``'s columns as an Arrow table of :func:`tokenized_features`' types. Labels
    that are the ids' own lists (every token trained) share the ids' Arrow array: converted once."""
    import pyarrow as pa

    kind = pa.list_(pa.int32())
    ids = pa.array(columns["input_ids"], type=kind)
    same = all(a is b for a, b in zip(columns["input_ids"], columns["labels"]))
    return pa.table({"input_ids": ids, "labels": ids if same else pa.array(columns["labels"], type=kind)})


def merged_stats(work: Path, shards: int) -> dict:
    """The shards' counts summed, with the length percentiles of every kept sample."""
    import numpy as np

    out = dict.fromkeys(COUNTS, 0)
    lengths = []
    for shard in range(shards):
        counts = json.loads((work / f"{shard:05d}.json").read_text())
        for k in COUNTS:
            out[k] += counts.get(k, 0)
        lengths.append(np.load(work / f"{shard:05d}.lengths.npy"))
    ordered = np.sort(np.concatenate(lengths))
    if len(ordered):
        for p in (50, 90, 99):
            out[f"length_p{p}"] = int(ordered[min(len(ordered) - 1, (p * len(ordered)) // 100)])
        out["length_max"] = int(ordered[-1])
    return out


def tokenized_features() -> Any:
    import datasets

    return datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32")),
                              "labels": datasets.Sequence(datasets.Value("int32"))})


def load_shards(folder: Path, in_memory: bool = False) -> Any:
    """The shards in ``folder`` as one Dataset: memory-mapped, or read into memory. (Only the
    shards: the cache files datasets writes beside them for a later ``map`` are not data.)"""
    import datasets

    shards = sorted(p for p in folder.glob("*.arrow") if SHARD_NAME.fullmatch(p.name))
    parts = [datasets.Dataset.from_file(str(p), in_memory=in_memory) for p in shards]
    ARROW_PAGES.release()  # opening them read each record batch's header
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def quiet_library_progress_bars() -> None:
    """ftcore draws its own bars; the libraries' tqdm bars would interleave with them."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()


def padding_fraction(lengths: list[int], batch_size: int) -> float:
    """Share of pad tokens when consecutive samples are batched and padded to the longest."""
    padded = real = 0
    for i in range(0, len(lengths), batch_size):
        chunk = lengths[i:i + batch_size]
        padded += max(chunk) * len(chunk)
        real += sum(chunk)
    return 1 - real / padded if padded else 0.0


def packing_report(dataset: Any, max_length: int, batch_size: int, packed: bool = True) -> dict[str, Any]:
    """Padding without packing and, with ``packed``, with best-fit packing (TRL's ``pack_dataset``,
    strategy "bfd")."""
    from trl.data_utils import pack_dataset

    lengths = [len(x) for x in dataset["input_ids"]]
    shuffled = random.Random(0).sample(lengths, len(lengths))  # batches are drawn in random order
    if not packed:
        return {"padding_fraction_unpacked": padding_fraction(shuffled, batch_size)}
    packed = pack_dataset(dataset.select_columns(["input_ids"]), max_length, strategy="bfd")
    bins = len(packed)
    return {"padding_fraction_unpacked": padding_fraction(shuffled, batch_size),
            "packed_sequences": bins,
            "packing_efficiency": sum(lengths) / (bins * max_length) if bins else 0.0,
            "padding_fraction_packed": 1 - sum(lengths) / (bins * max_length) if bins else 0.0}
