"""Train/eval overlap: the rows of a plan's evaluation data that repeat rows of its training data, which
make the numbers after training look better than the model is.

*Evaluation data* is what an ``[[evaluate]]`` and a stage's ``eval_data`` read, *training data* what the
stages' ``data`` read (a mix's sources in its place, in both). A source the stages train on is not evaluation
data, even through another split: dedup runs before a source's split. A streaming training source is not
compared (it is never held whole).

What is compared is each row's prompt as its user wrote it (:func:`prompt_text`), normalised as dedup
normalises (:func:`ftcore_plugins.data._quality.normalize`), and a row's images (the same question about
another image is no overlap). An eval row is an *exact* overlap of a training
source when a row of it has the same prompt, a *near* one when, without that, a row of it has word 3-gram
shingles with a Jaccard similarity of at least ``overlap_threshold``: MinHash LSH (datasketch, through
:class:`~ftcore_plugins.data._quality.NearDuplicates`) finds the candidates and their shingles confirm
them. The eval rows are indexed, being few; the training rows stream past the index a batch at a time,
so memory grows with the eval data only.

Each eval source counts its overlap with each training source in its data report (``train_overlap``),
warns with the counts, and under ``train_overlap = "drop"`` leaves the overlapping rows out.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from ftcore.errors import FtcoreError

from ftcore_plugins.common.prepare import ARROW_BATCH_ROWS, ARROW_PAGES
from ftcore_plugins.data._quality import NearDuplicates, _shingles, normalize, rows_where

# LSH is asked for candidates this far below the threshold, so that fewer pairs at the threshold are
# missed; the shingles then decide.
LSH_MARGIN = 0.1


def prompt_text(row: dict) -> str:
    """What the overlap compares of a row, normalised: a chat row's user turns, a prompt/completion or
    preference row's prompt (its user turns when it is messages), a text row's text. Answers are left out:
    an eval question trained on with another answer was still seen. Turns without a user one: all of them."""
    for key in ("messages", "prompt"):
        value = row.get(key)
        if isinstance(value, str):
            return normalize(value)
        if isinstance(value, list):
            turns = [m for m in value if isinstance(m, dict)]
            users = [str(m.get("content") or "") for m in turns if m.get("role") == "user"]
            return normalize("\n".join(users or [str(m.get("content") or "") for m in turns]))
    return normalize(row["text"]) if isinstance(row.get("text"), str) else ""


def compared(row: dict) -> tuple[str, str]:
    """``(prompt, images)``: the row's :func:`prompt_text` and its images' references, joined ("" without)."""
    return prompt_text(row), "\n".join(str(i) for i in row.get("images") or ())


def _row_shingles(text: str, images: str) -> set[bytes]:
    """The word 3-gram shingles of a prompt; a row with images has them salted with its images, so that
    the same question about other images shares none."""
    shingles = _shingles(text)
    return {images.encode() + b"\0" + s for s in shingles} if images else shingles


# -- which data is which -------------------------------------------------------------------------------

def _leaves(plan: Any, ref: str, seen: tuple[str, ...] = ()) -> list[str]:
    """A data reference, a mix's sources in its place."""
    name = ref.partition(":")[0]
    sources = getattr(plan.data[name].options, "sources", None) if name in plan.data else None
    if isinstance(sources, dict) and name not in seen:
        return [leaf for sub in sources for leaf in _leaves(plan, sub, (*seen, name))]
    return [ref]


def training_refs(plan: Any) -> list[str]:
    """The data references the stages train on, each once."""
    return list(dict.fromkeys(leaf for stage in plan.stages for leaf in _leaves(plan, stage.data)))


def evaluation_refs(plan: Any) -> list[str]:
    """The data references the plan evaluates on (``[[evaluate]]``, stages' ``eval_data``), each once, less
    the sources a stage trains on."""
    trained = {ref.partition(":")[0] for ref in training_refs(plan)}
    refs = [e.data for e in plan.evaluations if e.data] + [s.eval_data for s in plan.stages if s.eval_data]
    leaves = dict.fromkeys(leaf for ref in refs for leaf in _leaves(plan, ref))
    return [ref for ref in leaves if ref.partition(":")[0] not in trained]


def plan_problems(options: Any, plan: Any) -> list[str]:
    """``train_overlap = "drop"`` on a source that is no evaluation data: it would drop nothing."""
    name = next((n for n, sel in plan.data.items() if sel.options is options), None)
    if getattr(options, "train_overlap", None) != "drop" or name is None:
        return []
    stages = [s.name for s in plan.stages if name in {r.partition(":")[0] for r in _leaves(plan, s.data)}]
    if stages:
        return [f"train_overlap: \"drop\" leaves out the evaluation rows that repeat training rows, but stage "
                f"'{stages[0]}' trains on data.{name}"]
    if not any(ref.partition(":")[0] == name for ref in evaluation_refs(plan)):
        return [f"train_overlap: \"drop\" applies to evaluation data, and no [[evaluate]] or stage eval_data "
                f"reads data.{name}"]
    return []


# -- the comparison ------------------------------------------------------------------------------------

def _batches(data: Any) -> Iterator[list[tuple[str, str]]]:
    """What is compared of ``data``'s rows (:func:`compared`), a batch at a time (a memory-mapped dataset
    stays on disk)."""
    if hasattr(data, "iter"):
        for batch in data.iter(batch_size=ARROW_BATCH_ROWS):
            yield [compared(dict(zip(batch, values))) for values in zip(*batch.values())]
            ARROW_PAGES.check()
        return
    rows = list(data)
    for lo in range(0, len(rows), ARROW_BATCH_ROWS):
        yield [compared(dict(row)) for row in rows[lo:lo + ARROW_BATCH_ROWS]]


class EvalIndex:
    """One evaluation split's prompts, indexed for training rows to be compared against: by text for exact
    overlap, by MinHash LSH for near overlap. A row with an empty prompt is not compared."""

    def __init__(self, data: Any, threshold: float):
        self.threshold = threshold
        self.rows = 0
        self.exact: dict[tuple[str, str], list[int]] = defaultdict(list)
        self.keys: list[int] = []  # LSH key -> eval row
        self.shingles: list[set[bytes]] = []
        self.near = NearDuplicates(max(threshold - LSH_MARGIN, 0.05))
        for batch in _batches(data):
            for i, (text, images) in enumerate(batch, self.rows):
                if text:
                    self.exact[text, images].append(i)
                    self.keys.append(i)
                    self.shingles.append(_row_shingles(text, images))
            self.rows += len(batch)
        self.near.add(self.shingles)
        sizes = [len(s) for s in self.shingles] or [0]
        # Jaccard is at most the smaller set's size over the larger's: training rows outside these sizes
        # cannot be near any eval row and are not hashed (a corpus of long documents against short prompts).
        self.sizes = (threshold * min(sizes), max(sizes) / threshold)

    def compare(self, data: Any) -> tuple[Any, Any]:
        """Boolean arrays over the eval rows: those whose prompt is a prompt of ``data``, and the others
        near one."""
        import numpy as np

        exact, near = np.zeros(self.rows, dtype=bool), np.zeros(self.rows, dtype=bool)
        if not self.keys:
            return exact, near
        for batch in _batches(data):
            candidates = []
            for text, images in batch:
                if not text:
                    continue
                exact[self.exact.get((text, images), [])] = True
                shingles = _row_shingles(text, images)
                if self.sizes[0] <= len(shingles) <= self.sizes[1]:
                    candidates.append(shingles)
            for shingles, keys in zip(candidates, self.near.similar(candidates)):
                for key in keys:
                    row, theirs = self.keys[key], self.shingles[key]
                    if not near[row] and len(shingles & theirs) >= self.threshold * len(shingles | theirs):
                        near[row] = True
        return exact, near & ~exact


def overlap_key(split: str) -> str:
    """The data report's key for a split's overlap: ``train_overlap``, ``validation_train_overlap``."""
    return "train_overlap" if split == "train" else f"{split}_train_overlap"


def messages(name: str, stats: dict[str, Any]) -> list[str]:
    """The warnings a source's data report asks for: one per training source that its rows repeat."""
    out = []
    for key, found in stats.items():
        if not key.endswith("train_overlap") or not isinstance(found, dict):
            continue
        split = key.removesuffix("train_overlap").rstrip("_") or "train"
        shown = name if split == "train" else f"{name}:{split}"
        for train, n in found.items():
            if n["exact"] or n["near"]:
                out.append(f"{n['exact'] + n['near']:,} of {n['rows']:,} rows of eval source '{shown}' repeat "
                           f"training rows of '{train}' ({n['exact']:,} exact, {n['near']:,} near)")
    return out


def check_overlap(parts: dict[str, Any], options: Any, ctx: Any, stats: dict[str, Any]) -> dict[str, Any]:
    """Compare each split of ``parts`` (source ``ctx.name``, loaded) that the plan evaluates on with each
    training data: counts in ``stats``, a warning per training source repeated, and the repeating rows
    left out under ``train_overlap = "drop"``. Returns the parts."""
    import numpy as np

    plan = getattr(getattr(ctx, "run", None), "plan", None)
    if getattr(options, "train_overlap", "off") == "off" or plan is None or ctx.data is None:
        return parts
    splits = {(ref.partition(":")[2] or "train"): ref for ref in evaluation_refs(plan)
              if ref.partition(":")[0] == ctx.name}
    training = {ref: ctx.data(ref) for ref in training_refs(plan)} if splits else {}
    streams = [ref for ref, data in training.items() if not hasattr(data, "__len__")]
    if streams:  # never held whole: reading it here would read the whole corpus once more
        ctx.reporter.info(f"data [bold]{ctx.name}[/]: not compared with {', '.join(streams)}: streaming data")
    training = {ref: data for ref, data in training.items() if ref not in streams}
    dropped = 0
    for split, ref in splits.items():
        if split not in parts or not training:
            continue
        index = EvalIndex(parts[split], options.overlap_threshold)
        found = {train: index.compare(data) for train, data in training.items()}
        counts = {train: {"rows": index.rows, "exact": int(exact.sum()), "near": int(near.sum())}
                  for train, (exact, near) in found.items()}
        stats[overlap_key(split)] = counts
        ctx.reporter.table(f"data {ref}: rows repeating training rows", ["training data", "eval rows", "exact", "near"],
                           [[train, n["rows"], n["exact"], n["near"]] for train, n in counts.items()])
        for line in messages(ctx.name, {overlap_key(split): counts}):
            ctx.reporter.warn(line)
        repeats = np.logical_or.reduce([exact | near for exact, near in found.values()])
        if options.train_overlap != "drop" or not repeats.any():
            continue
        if repeats.all():
            raise FtcoreError(f"data.{ctx.name}: all {index.rows:,} rows of '{ref}' repeat training rows; "
                              "train_overlap = \"drop\" leaves none to evaluate on")
        parts[split] = rows_where(parts[split], ~repeats)
        dropped += int(repeats.sum())
        if f"{split}_rows" in stats:  # the split's own count, in a source that holds rows out
            stats[f"{split}_rows"] -= int(repeats.sum())
        ctx.reporter.info(f"data [bold]{ref}[/]: dropped {int(repeats.sum()):,} rows that repeat training rows "
                          f"(train_overlap = \"drop\"); {len(parts[split]):,} left")
    if dropped:
        stats["dropped_train_overlap"] = dropped
        if "rows_kept" in stats:
            stats["rows_kept"] -= dropped
    return parts
