"""Row-level data quality and splits, shared by the data sources.

Order, applied by ``clean_and_split``: filters -> exact dedup -> near dedup -> split.
Dedup runs before the split, so a duplicate can never sit on both sides of it.
Every step counts what it removed, for the data report.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import unicodedata
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any, Literal

from pydantic import Field, model_validator

from ftcore.component import Options
from ftcore.errors import FtcoreError

from ftcore_plugins.common.prepare import ARROW_BATCH_ROWS, ARROW_PAGES


class QualityOptions(Options):
    """Options every built-in data source takes (see docs/data.md)."""

    # "none" keeps every row (duplicates are still counted); "near": exact, then MinHash near-duplicates
    dedup: Literal["none", "exact", "near"] = "none"
    near_threshold: float = Field(0.7, gt=0, lt=1)  # estimated Jaccard similarity of word 3-gram shingles
    # Evaluation data only: its rows whose prompt repeats a training row's (ftcore_plugins.data._overlap) are
    # counted and warned about ("report"), also left out ("drop"), or not looked for ("off").
    train_overlap: Literal["report", "drop", "off"] = "report"
    # Above near_threshold: one word changed at the end of an 8-word prompt is 0.71, and short prompts that
    # differ that little ask something else (at 0.7, 82 of the quickstart's 100 held-out rows were "near").
    overlap_threshold: float = Field(0.8, gt=0, lt=1)
    min_chars: int = Field(1, ge=0)  # drop rows whose text is shorter (1: drop empty rows)
    drop_non_text: bool = True  # drop rows that look like binary or encoded data, not text
    max_chars: int | None = Field(None, gt=0)  # drop rows whose text is longer
    validation: float | int | None = None  # a share (0 < x < 1) or a row count held out for validation
    split_strategy: Literal["random", "stratified", "grouped"] = "random"
    split_by: str | None = None  # the column for stratified or grouped splits (list it in `keep` too)
    seed: int = Field(42, ge=0)

    @model_validator(mode="after")
    def _split_needs_column(self):
        if self.split_strategy != "random" and not self.split_by:
            raise ValueError(f"split_strategy = '{self.split_strategy}' needs split_by = \"<column>\"")
        if isinstance(self.validation, float) and not 0 < self.validation < 1:
            raise ValueError("validation must be a share between 0 and 1, or a whole number of rows")
        if isinstance(self.validation, int) and self.validation < 1:
            raise ValueError("validation must be at least 1 row")
        return self


def normalized_text(row: dict) -> str:
    """All the text of a row in the internal schema, normalised for comparison:
    Unicode NFKC, lower case, collapsed whitespace. Roles are kept, so a user turn and
    an assistant turn with the same words differ."""
    parts = []
    for key in ("text", "prompt", "completion", "messages", "chosen", "rejected"):
        value = row.get(key)
        if isinstance(value, str):
            parts.append(f"{key}:{value}")
        elif isinstance(value, list):
            parts.extend(f"{m.get('role')}:{m.get('content')}" for m in value if isinstance(m, dict))
    if "label" in row and row["label"] is not None:
        parts.append(f"label:{row['label']}")
    return normalize("\n".join(parts))


def normalize(text: str) -> str:
    """Text as dedup and the train/eval overlap compare it: Unicode NFKC, lower case, collapsed whitespace."""
    return re.sub(r"\s+", " ", unicodedata.normalize("NFKC", text).lower()).strip()


def content_text(row: dict) -> str:
    """The row's text as written, without roles: what length filters measure."""
    parts = []
    for key in ("text", "prompt", "completion"):
        if isinstance(row.get(key), str):
            parts.append(row[key])
    for key in ("messages", "prompt", "completion", "chosen", "rejected"):
        if isinstance(row.get(key), list):
            parts.extend(str(m.get("content", "")) for m in row[key] if isinstance(m, dict))
    return "".join(parts)


def looks_like_text(text: str) -> bool:
    """False for binary or encoded blobs: over 1% control characters or U+FFFD (bytes
    that did not decode), or an unbroken run of 200+ base64 characters using at least 16
    distinct symbols. Code, numbers, bit strings and a stray mis-decoded character in
    real text count as text."""
    junk = sum(1 for c in text if c == "\ufffd" or (unicodedata.category(c) == "Cc" and c not in "\n\r\t\f"))
    if junk > 0.01 * len(text):
        return False
    # Encoded data mixes many symbols; a long run of one digit (a bit string) is still text.
    return not any(len(set(run)) >= 16 for run in re.findall(r"[A-Za-z0-9+/=]{200,}", text))


def _shingles(text: str, n: int = 3) -> set[bytes]:
    words = text.split()
    if len(words) < n:
        return {" ".join(words).encode()}
    return {" ".join(words[i:i + n]).encode() for i in range(len(words) - n + 1)}


EXACT_BYTES_PER_ROW = 60  # exact dedup at its peak (the sort at the end), measured at 1M rows: 60 (RESULTS.md)


class ExactDuplicates:
    """Which rows repeat an earlier row's normalised text. Each row's 8-byte digest (blake2b) goes
    into one numpy array, sized for ``rows`` up front (8 bytes a row; a Python set of 16-byte
    digests took 160), and :meth:`repeats` finds the repeats at the end with one stable argsort
    (8 bytes a row more, and the sort's scratch). The first occurrence of a text is never a repeat.
    Two different texts share a digest with a chance of about rows**2 / 2**65: 3 in 10,000 at 100
    million rows (and then one row is dropped that should not be)."""

    def __init__(self, rows: int = 0):
        import numpy as np

        self.digests, self.size = np.empty(rows, dtype=np.uint64), 0

    def add(self, texts: list[str]) -> None:
        import numpy as np

        new = np.frombuffer(b"".join(hashlib.blake2b(t.encode(), digest_size=8).digest() for t in texts),
                            dtype=np.uint64)
        end = self.size + len(new)
        if end > len(self.digests):  # more rows than announced: grow by doubling
            grown = np.empty(max(end, 2 * len(self.digests)), dtype=np.uint64)
            grown[:self.size] = self.digests[:self.size]
            self.digests = grown
        self.digests[self.size:end] = new
        self.size = end

    def repeats(self) -> Any:
        """A boolean array over the rows added, in order: True where the text came before."""
        import numpy as np

        digests = self.digests[:self.size]
        order = np.argsort(digests, kind="stable")  # equal digests stay in row order
        out = np.zeros(len(digests), dtype=bool)
        step = 1 << 20  # compared a million at a time: no full sorted copy of the digests
        for lo in range(1, len(order), step):
            here = order[lo:lo + step]
            out[here] = digests[here] == digests[order[lo - 1:lo - 1 + len(here)]]
        return out


class NearDuplicates:
    """MinHash LSH (datasketch) over rows as they come: a row is a near-duplicate when its
    estimated Jaccard similarity to an earlier kept row is at least ``threshold``.

    Memory: the index keeps each kept row's band hashes, about ``BYTES_PER_ROW`` bytes a row
    (measured: benchmarks/dedup_memory.py), so it grows with the corpus; nothing else is held."""

    BYTES_PER_ROW = 5_350  # measured at 1M rows (5,332), 128 permutations, threshold 0.7 (RESULTS.md)

    def __init__(self, threshold: float, seed: int = 1, num_perm: int = 128):
        from datasketch import MinHashLSH

        self.lsh, self.seed, self.num_perm, self.size = MinHashLSH(threshold=threshold, num_perm=num_perm), seed, \
            num_perm, 0

    def hashes(self, shingles: Iterable[set[bytes]]) -> Iterator[Any]:
        """Each row's MinHash, from its shingles (:func:`_shingles`)."""
        from datasketch import MinHash

        return MinHash.generator(shingles, num_perm=self.num_perm, seed=self.seed)

    def add(self, shingles: Iterable[set[bytes]]) -> None:
        """Index every row given, under keys counted from 0 in the order added (the train/eval overlap
        indexes the eval rows this way, then asks :meth:`similar` for each training row)."""
        for h in self.hashes(shingles):
            self.lsh.insert(self.size, h)
            self.size += 1

    def similar(self, shingles: Iterable[set[bytes]]) -> list[list[int]]:
        """For each row given, the keys of the indexed rows LSH puts beside it: candidates whose estimated
        similarity is near the threshold or above, not checked."""
        return [self.lsh.query(h) for h in self.hashes(shingles)]

    def new(self, texts: list[str]) -> list[bool]:
        """For each text in order: True when it is not a near-duplicate of one kept before (it is kept)."""
        out = []
        for h in self.hashes(_shingles(t) for t in texts):
            if self.lsh.query(h):
                out.append(False)
                continue
            self.lsh.insert(self.size, h)
            self.size += 1
            out.append(True)
        return out


def filtered_out(row: dict, o: QualityOptions) -> str | None:
    """Why the row-by-row filters drop ``row`` ("empty", "too_short", "too_long", "non_text"), or None."""
    text = content_text(row)
    stripped = text.strip()
    if len(stripped) < o.min_chars:
        return "empty" if not stripped else "too_short"
    if o.max_chars is not None and len(text) > o.max_chars:
        return "too_long"
    if o.drop_non_text and not looks_like_text(stripped):
        return "non_text"
    return None


def memory_warning(rows: int, per_row: int, where: str) -> str | None:
    """Why near dedup of ``rows`` rows may not fit: its index would take over half the memory
    available now. None when it fits."""
    from ftcore_plugins.common import memory

    need, available = rows * per_row, memory.available_bytes()
    if not available or need <= available / 2:
        return None
    return (f"{where}: near dedup of {rows:,} rows holds about {need / 2**30:.1f} GiB of MinHash bands in memory "
            f"({per_row:,} bytes a row) and {available / 2**30:.1f} GiB is available; dedup the corpus in parts, "
            f"or use dedup = \"exact\" (about {EXACT_BYTES_PER_ROW} bytes a row)")


def clean_and_split(data: Any, o: QualityOptions, stats: dict[str, Any], where: str,
                    warn: Any = None) -> dict[str, Any]:
    """Filter, dedup and split a dataset. Returns ``{"train": ds}`` or
    ``{"train": ds, "validation": ds}``; adds counts to ``stats``.

    Rows are read in batches and only masks and 8-byte digests (and MinHashes for near dedup)
    are held, so a memory-mapped dataset larger than memory stays on disk. Exact repeats are
    found at the end (:class:`ExactDuplicates`); near dedup sees every row that passes the
    filters, and since an exact repeat is always a near-duplicate of its first occurrence, it
    keeps the same rows as dedup in two steps would, and repeats are counted as duplicates."""
    import numpy as np

    dropped: dict[str, int] = defaultdict(int)
    passed = np.zeros(len(data), dtype=bool)  # by the filters
    exact = ExactDuplicates(len(data))
    near = NearDuplicates(o.near_threshold, seed=o.seed) if o.dedup == "near" else None
    near_new = np.zeros(len(data), dtype=bool) if near is not None else None
    if near is not None and warn is not None and (message := memory_warning(len(data), near.BYTES_PER_ROW, where)):
        warn(message)
    offset = 0
    for batch in data.iter(batch_size=ARROW_BATCH_ROWS):  # memory-mapped: the pages read are handed back
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        candidates: list[tuple[int, str]] = []
        for i, row in enumerate(rows, offset):
            reason = filtered_out(row, o)
            if reason is not None:
                dropped[reason] += 1
                continue
            passed[i] = True
            candidates.append((i, normalized_text(row)))
        texts = [t for _, t in candidates]
        exact.add(texts)
        if near is not None:  # one batch's texts at a time: the index holds hashes, never the corpus's text
            near_new[[i for i, _ in candidates]] = near.new(texts)
        offset += len(rows)
        ARROW_PAGES.check()
    repeats = exact.repeats()  # over the rows that passed the filters, in order
    duplicates = int(repeats.sum())
    keep = passed  # a mask over the rows
    if o.dedup == "exact":
        keep[passed] = ~repeats
        dropped["duplicate"] = duplicates
    elif near is not None:
        keep = near_new
        dropped["duplicate"] = duplicates
        dropped["near_duplicate"] = int(passed.sum()) - int(keep.sum()) - duplicates
    del repeats
    dropped = {k: v for k, v in dropped.items() if v}
    if o.dedup == "none" and duplicates:  # found but kept
        stats["duplicates_kept"] = duplicates
    stats.update({f"dropped_{k}": v for k, v in dropped.items()})
    stats["rows_kept"] = kept_rows = int(keep.sum())
    if kept_rows == 0:
        raise FtcoreError(f"{where}: no row is left after filtering and deduplication ({dict(dropped)})")
    kept = data if kept_rows == len(data) else rows_where(data, keep)
    if o.validation is None:
        return {"train": kept}
    labels = kept[o.split_by] if o.split_strategy != "random" and o.split_by in kept.column_names else None
    if o.split_strategy != "random" and labels is None:
        raise FtcoreError(f"{where}: split_by = '{o.split_by}' but the rows have no such column "
                          f"(columns: {', '.join(kept.column_names)}); add it to keep = [...]")
    held = held_out(len(kept), labels, o, where)
    stats["validation_rows"] = int(held.sum())
    stats["train_rows"] = len(kept) - stats["validation_rows"]
    return {"train": rows_where(kept, ~held), "validation": rows_where(kept, held)}


def rows_where(data: Any, mask: Any) -> Any:
    """The rows of ``data`` where the boolean array ``mask`` is True, in order. A filter writes the
    indices batch by batch, beside the data's cache files when it has some (select(indices) holds
    them as a Python list, about 40 bytes a row, and keeps them in memory)."""
    fingerprint = hashlib.sha256(f"{data._fingerprint}:rows_where:".encode() + mask.tobytes()).hexdigest()[:16]
    return data.filter(lambda indices: mask[indices], with_indices=True, batched=True, input_columns=[],
                       batch_size=ARROW_BATCH_ROWS, writer_batch_size=ARROW_BATCH_ROWS, new_fingerprint=fingerprint)


def held_out(n: int, labels: list | None, o: QualityOptions, where: str) -> Any:
    """Which of ``n`` rows are held out for validation (a boolean array), seeded: at random,
    stratified by ``labels`` (each value keeps its share on both sides), or grouped by them (a
    group never straddles)."""
    import numpy as np

    want = o.validation if isinstance(o.validation, int) else round(n * o.validation)
    if not 1 <= want < n:
        raise FtcoreError(f"{where}: validation = {o.validation} leaves {n - want} training rows of {n}; "
                          "choose a smaller share")
    held = np.zeros(n, dtype=bool)
    if o.split_strategy == "random":  # numpy: no Python list of the rows (a shuffled one took ~40 bytes a row)
        held[np.random.default_rng(o.seed).choice(n, size=want, replace=False)] = True
        return held
    rng = random.Random(o.seed)
    groups: dict[str, list[int]] = defaultdict(list)
    for i, value in enumerate(labels):
        groups[json.dumps(value, sort_keys=True, default=str)].append(i)
    validation: list[int] = []
    if o.split_strategy == "stratified":
        share = want / n
        for key in sorted(groups):
            members = groups[key][:]
            rng.shuffle(members)
            validation += members[: round(len(members) * share)]
    else:  # grouped: whole groups, in a seeded order, until the target is reached
        keys = sorted(groups)
        rng.shuffle(keys)
        for key in keys:
            if len(validation) >= want:
                break
            validation += groups[key]
        if len(validation) >= n:
            raise FtcoreError(f"{where}: split_by = '{o.split_by}' has too few groups to hold out {want} rows "
                              "and keep any for training")
    held[validation] = True
    return held
