"""Tokenized datasets for trainers and evaluators: masked, length-limited, cached on disk.

The cache key covers everything that changes the result: the rows' content, the
tokenizer (vocabulary, merges, special tokens, chat template), the chat template
component (name, options and what it renders for a probe conversation), every
tokenization option, and ``DATA_LAYER_VERSION``. Entries live in
``ftcore.cache.cache_dir()/tokenized``, outside any run directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import uuid
from dataclasses import dataclass
from typing import Any

from ftcore.cache import cache_dir

from ftcore_plugins.common.chat import Truncation, encode

DATA_LAYER_VERSION = 3  # bump when tokenization or masking changes behaviour

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
    for table in rows.with_format("arrow").iter(batch_size=10_000):
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        h.update(sink.getvalue())
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
            use_cache: bool = True, on_error: str = "error", where: str = "data") -> Prepared:
    import datasets

    quiet_library_progress_bars()
    options = {"max_length": max_length, "truncation": truncation, "train_on_inputs": train_on_inputs,
               "add_eos_to_text": add_eos_to_text, "on_error": on_error}
    key = hashlib.sha256(json.dumps({
        "version": DATA_LAYER_VERSION, "data": data_fingerprint(rows), "tokenizer": tokenizer_fingerprint(tokenizer),
        "template": template_fingerprint(template, tokenizer), "options": options}, sort_keys=True).encode()
    ).hexdigest()
    folder = cache_dir() / "tokenized" / key[:2] / key
    if use_cache and (folder / "stats.json").exists():
        try:
            stats = json.loads((folder / "stats.json").read_text())
            return Prepared(datasets.load_from_disk(str(folder / "data")), stats, True, key)
        except (OSError, ValueError, FileNotFoundError):
            pass  # a damaged entry: rebuild it below
    columns, encoded = encode(rows, tokenizer, template, max_length=max_length, truncation=truncation,
                              train_on_inputs=train_on_inputs, add_eos_to_text=add_eos_to_text,
                              reporter=reporter, description=description, on_error=on_error, where=where)
    dataset = datasets.Dataset.from_dict(columns, features=datasets.Features({
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "labels": datasets.Sequence(datasets.Value("int32"))}))
    stats = encoded.summary()
    if use_cache:
        _store(folder, dataset, stats)
    return Prepared(dataset, stats, False, key)


def _store(folder: Any, dataset: Any, stats: dict) -> None:
    """Write to a temporary folder, then rename: a killed run never leaves half an entry."""
    tmp = folder.with_name(f".{folder.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        tmp.mkdir(parents=True)
        dataset.save_to_disk(str(tmp / "data"))
        (tmp / "stats.json").write_text(json.dumps(stats))
        os.replace(tmp, folder)
    except OSError:
        if folder.exists():  # another process stored the same entry first
            shutil.rmtree(tmp, ignore_errors=True)
            return
        raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


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
