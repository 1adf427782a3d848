"""Data source ``mix``: several of the plan's data entries mixed by weight."""

from __future__ import annotations

import random
from typing import Annotated

from pydantic import Field

import ftcore
from ftcore.component import Component, Options
from ftcore.errors import FtcoreError

KIND_COLUMNS = ({"messages"}, {"prompt", "chosen", "rejected"}, {"prompt", "completion", "label"},
                {"prompt", "completion"}, {"text"})


def kind_columns(columns: set[str]) -> set[str]:
    for kind in KIND_COLUMNS:
        if kind <= columns:
            return kind
    return columns


class MixSource(Component):
    """Mixes other [data.*] entries by weight, e.g. 70% task data and 30% replay data."""

    name = "mix"

    class Options(Options):
        sources: dict[str, Annotated[float, Field(gt=0)]] = Field(min_length=1)  # data name (or name:split) -> weight
        rows: int | None = Field(None, gt=0)  # total rows; default: the most the weights allow without repeats
        seed: int = Field(42, ge=0)

    def check(self, plan):
        problems = []
        for ref, weight in self.options.sources.items():
            name = ref.partition(":")[0]
            if name not in plan.data:
                problems.append(f"sources: undefined data {name!r}; defined: {', '.join(plan.data)}")
            elif plan.data[name].reg.cls is MixSource:
                problems.append(f"sources: {name!r} is itself a mix; list its sources here instead")
            if weight <= 0:
                problems.append(f"sources: the weight of {ref!r} must be positive, got {weight}")
        return problems

    def load(self, ctx):
        import datasets

        o = self.options
        parts = {ref: ctx.data(ref) for ref in o.sources}
        kinds = {ref: kind_columns(set(d.column_names)) for ref, d in parts.items()}
        if len({frozenset(k) for k in kinds.values()}) > 1:
            described = "; ".join(f"{ref}: {', '.join(sorted(k))}" for ref, k in kinds.items())
            raise FtcoreError(f"data.{ctx.name}: cannot mix different kinds of rows ({described})")
        columns = sorted(set.intersection(*(set(d.column_names) for d in parts.values())))
        total_weight = sum(o.sources.values())
        shares = {ref: w / total_weight for ref, w in o.sources.items()}
        total = o.rows or int(min(len(parts[ref]) / share for ref, share in shares.items()))
        rng = random.Random(o.seed)
        picked, stats = [], {"rows": 0, "repeated_rows": 0}
        for ref, share in shares.items():
            data, want = parts[ref], round(total * share)
            # Without repeats while the source has enough rows; beyond that, whole passes plus a sample.
            indices = [i for _ in range(want // len(data)) for i in range(len(data))]
            indices += rng.sample(range(len(data)), want - len(indices))
            stats["repeated_rows"] += max(0, want - len(data))
            stats[f"rows_from_{ref}"] = want
            picked.append(data.select_columns(columns).select(indices))
        mixed = datasets.concatenate_datasets(picked).shuffle(seed=o.seed)
        stats["rows"] = len(mixed)
        self.stats = stats
        ctx.reporter.info(f"data [bold]{ctx.name}[/]: {len(mixed):,} rows mixed from "
                          + ", ".join(f"{ref} {stats[f'rows_from_{ref}']:,} ({shares[ref]:.0%})" for ref in shares))
        return mixed


@ftcore.hookimpl
def register_data_sources(register):
    register(MixSource)
