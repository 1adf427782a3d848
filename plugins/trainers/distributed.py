"""The ``[distributed]`` table, owned by the distributed engines (DDP, FSDP, DeepSpeed) the trainers
run: how many processes, which engine (docs/distributed.md). ``ftcore run`` hands the plan to it before
running: with more than one process it starts them under torchrun (``common/launch.py``) and waits;
in each worker it sets the process up and shares rank 0's decisions. It is not part of the plan's
fingerprint: a run may be resumed on other hardware."""

from __future__ import annotations

import os
import sys
from typing import Any

import ftcore
from ftcore.component import PlanSection

from ftcore_plugins.common.launch import Distributed


class DistributedSection(PlanSection):
    """[distributed]: processes, nodes and the engine that shares the work between them."""

    name = "distributed"
    Options = Distributed
    fingerprint = False

    @property
    def value(self) -> Distributed:
        """The table, or the one-process default where the plan has none."""
        return self.options or Distributed()

    def check(self, plan: Any) -> list[str]:
        d = self.value
        problems = d.problems(plan)
        if d.model_parallel > 1 and not problems:
            from ftcore_plugins.trainers._hybrid import model_config

            options = plan.model.options
            config = dict(model_config(plan) or {})
            # The scratch loader's own keys for what a config.json names otherwise.
            for key, own in (("num_attention_heads", "num_heads"), ("num_key_value_heads", "num_kv_heads")):
                if config.get(key) is None and getattr(options, own, None) is not None:
                    config[key] = getattr(options, own)
            problems += d.model_problems(config, getattr(options, "attn_implementation", None))
        if d.tp_size > 1 and d.processes > 1 and not problems and not getattr(plan.model.reg.cls, "tensor_parallel",
                                                                                False):
            # transformers' Trainer takes tensor parallelism from a model loaded split; a whole one runs as DDP
            problems.append(f"tp_size: model loader '{plan.model.name}' builds the whole model in every process, and "
                            "tensor parallelism needs each process's split of the weights loaded (the hf loader "
                            "does it); use [model] use = \"hf\", or sp_size for long rows, zero_stage = 3 for "
                            "weights that do not fit")
        return problems

    def launch(self, plan: Any, argv: list[str]) -> int | None:
        from ftcore_plugins.common import launch

        d = self.value
        if d.wanted and not launch.is_worker():
            print(f"ftcore: starting {d.nproc_per_node} process(es) on this node ({d.engine}, node {d.node_rank} of "
                  f"{d.nnodes})" if d.accelerate_config is None else f"ftcore: starting accelerate launch with "
                  f"{d.accelerate_config}", file=sys.stderr)
            return launch.launch(d, argv)
        launch.start_worker(d)
        return None

    def on_main(self, fn: Any) -> Any:
        from ftcore_plugins.common.launch import from_main

        return from_main(fn, int(os.environ.get("WORLD_SIZE", "1")))


@ftcore.hookimpl
def register_plan_sections(register):
    register(DistributedSection)
