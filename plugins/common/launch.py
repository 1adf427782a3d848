"""Scaling a run out: the plan's ``[distributed]`` table, and ``ftcore run`` re-run under torchrun.

``ftcore run`` with more than one process starts ``python -m torch.distributed.run ...
-m ftcore_plugins.common.launch run <same arguments>`` and waits: each worker runs the whole plan
(``ftcore``'s own command line, this module's ``__main__`` recording how the rank ended), rank 0
alone writes and prints. The table belongs to the distributed engines (``trainers/distributed.py``
registers it); the sweep command and the trainers read it too. Nothing here imports torch at module
level, so ``ftcore validate`` and ``--help`` stay light.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ftcore.types import InputPath

# Set by the launcher in the workers it starts: where they leave their exit codes and, for ranks
# above 0, their stderr. A worker started by a user's own torchrun has LOCAL_RANK instead.
LAUNCH_DIR = "FTCORE_LAUNCH_DIR"
WORKER = "ftcore_plugins.common.launch"  # what each worker runs: `ftcore`, its exit code recorded
ENGINE_KEYS = {"deepspeed": ("zero_stage", "offload_optimizer", "deepspeed_config"),
               "fsdp": ("fsdp_sharding", "fsdp_wrap")}
# The engine each axis runs on, as accelerate builds it, and why.
AXIS_ENGINES = (("sp_size", "deepspeed", "sequence parallelism is DeepSpeed's Ulysses (accelerate's only sp_backend)"),
                ("cp_size", "fsdp", "context parallelism is torch's, on FSDP2 (accelerate's only cp_backend)"))
# Layer types (transformers' ``layer_types``) that carry a state along the row: linear attention, Mamba,
# short convolutions, Falcon-H1's hybrid layers (Mamba beside attention).
RECURRENT_LAYERS = ("linear", "mamba", "conv", "hybrid", "recurrent", "ssm", "rwkv")
# Axes that run on CUDA GPUs only, and the check that stops each on a CPU (found by running them with 2
# processes on gloo, 2026-11-29).
CUDA_ONLY = {
    "cp_size": "context parallelism runs on CUDA GPUs only: torch's ring attention has kernels for CUDA's "
               "SDPA backends alone (on a CPU: \"Operator aten._scaled_dot_product_flash_attention_for_cpu."
               "default does not have a sharding strategy registered\"); use sp_size on a CPU",
    "tp_size": "tensor parallelism runs on GPUs only: accelerate refuses it for CPU processes (\"ParallelismConfig "
               "is only compatible DistributedType.FSDP (version 2) or DistributedType.Multi{Device} or "
               "DistributedType.DEEPSPEED, but got DistributedType.MULTI_CPU\")",
}
# The attention kernels accelerate refuses to wrap in Ulysses (DeepSpeedSequenceParallelConfig).
ULYSSES_REFUSES = ("eager", "flex_attention")
PIPELINE_WHY = ("pipeline parallelism is not supported: transformers' Trainer, which every ftcore trainer runs on, "
                "has no pipeline schedule; to fit the weights use zero_stage = 3 or engine = \"fsdp\", to fit "
                "long rows sp_size, to split each layer tp_size (docs/distributed.md)")
# Exit codes of a rank stopped by a signal (the launcher's SIGTERM when another rank failed, a Ctrl-C).
STOPPED = (130, 143)
# FSDP2 (the only FSDP transformers 5 keeps) shards fully or keeps parameters gathered between
# forward and backward; FSDP1's hybrid and no-shard strategies are gone.
FSDP2_SHARDING = {"full_shard": True, "shard_grad_op": False}


class Distributed(BaseModel):
    """The ``[distributed]`` section. Not part of the plan fingerprint: the same run may be resumed
    on other hardware."""

    model_config = ConfigDict(extra="forbid")

    engine: Literal["ddp", "fsdp", "deepspeed"] = "ddp"
    nproc_per_node: int = Field(1, ge=1)
    nnodes: int = Field(1, ge=1)
    node_rank: int = Field(0, ge=0)
    master_addr: str = "127.0.0.1"
    master_port: int = Field(29500, ge=1, le=65535)
    rdzv_endpoint: str | None = None  # host:port of a c10d rendezvous (elastic), instead of master_addr/port
    rdzv_backend: Literal["static", "c10d"] = "static"
    zero_stage: Literal[2, 3] = 2
    offload_optimizer: bool = False
    offload_params: bool = False
    fsdp_sharding: Literal["full_shard", "shard_grad_op", "hybrid_shard", "no_shard"] = "full_shard"
    fsdp_wrap: Literal["transformer_layer", "size"] = "transformer_layer"
    deepspeed_config: InputPath | None = None  # a DeepSpeed JSON, passed to transformers as it is
    accelerate_config: InputPath | None = None  # an accelerate config: launched with `accelerate launch`
    backend: Literal["auto", "nccl", "gloo"] = "auto"  # auto: nccl with CUDA, gloo on CPU
    # Axes beside data parallelism (docs/distributed.md): each row is split across sp_size processes
    # (DeepSpeed's Ulysses), or across cp_size (torch's context parallel on FSDP2); each layer's weights
    # across tp_size (transformers' tp_plan). The processes left over run data parallel.
    sp_size: int = Field(1, ge=1)
    cp_size: int = Field(1, ge=1)
    tp_size: int = Field(1, ge=1)
    pp_size: int = Field(1, ge=1)  # refused above 1 (PIPELINE_WHY), kept so the plan gets the reason

    @property
    def processes(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def model_parallel(self) -> int:
        """Processes that share one batch (the product of the axes); the rest run data parallel."""
        return self.sp_size * self.cp_size * self.tp_size

    @property
    def data_parallel(self) -> int:
        return max(1, self.processes // self.model_parallel)

    @property
    def wanted(self) -> bool:
        """More than one process, or an accelerate config that decides how many."""
        return self.processes > 1 or self.accelerate_config is not None

    def problems(self, plan: Any = None) -> list[str]:
        """``"key: message"`` for settings that do not go together (nothing is imported)."""
        out = []
        chosen = self.model_fields_set
        if self.node_rank >= self.nnodes:
            out.append(f"node_rank: must be below nnodes ({self.nnodes}), got {self.node_rank}")
        if self.rdzv_backend == "c10d" and not self.rdzv_endpoint:
            out.append("rdzv_backend: \"c10d\" needs rdzv_endpoint = \"<host>:<port>\"")
        for engine, keys in ENGINE_KEYS.items():
            out += [f"{key}: only used with engine = \"{engine}\" (engine is \"{self.engine}\")"
                    for key in keys if key in chosen and self.engine != engine]
        if self.offload_params and self.engine == "ddp":
            out.append("offload_params: only used with engine = \"deepspeed\" or \"fsdp\"")
        if self.engine == "fsdp" and self.fsdp_sharding not in FSDP2_SHARDING:
            out.append(f"fsdp_sharding: \"{self.fsdp_sharding}\" was FSDP1's; transformers 5 runs FSDP2, which "
                       "supports \"full_shard\" and \"shard_grad_op\" (for no sharding use engine = \"ddp\")")
        if self.engine == "fsdp" and self.offload_optimizer:
            out.append("offload_optimizer: FSDP offloads parameters, gradients and the optimizer step together; "
                       "set offload_params = true instead")
        if self.engine == "deepspeed":
            if importlib.util.find_spec("deepspeed") is None:
                out.append("engine: \"deepspeed\" needs DeepSpeed, which is not installed; "
                           "install it with: pip install 'ftcore[distributed]'")
            if self.offload_params and self.zero_stage != 3:
                out.append("offload_params: DeepSpeed offloads parameters only with zero_stage = 3")
            if self.deepspeed_config is not None:
                out += [f"{key}: set in your deepspeed_config instead (it is used as it is)"
                        for key in ("zero_stage", "offload_optimizer", "offload_params") if key in chosen]
        if self.accelerate_config is not None:
            out += [f"{key}: the accelerate_config decides it; remove it here"
                    for key in ("engine", "nproc_per_node", "backend") if key in chosen]
        out += self.axis_problems()
        if plan is not None and self.tp_size > 1 and self.processes > 1 and plan.quantizer.name != "none":
            out.append(f"tp_size: tensor parallelism splits full-precision weights; quantizer "
                       f"'{plan.quantizer.name}' keeps them packed, so use one or the other")
        if plan is not None and self.engine in ("fsdp", "deepspeed") and self.wanted \
                and plan.quantizer.name != "none":
            out.append(f"engine: \"{self.engine}\" does not shard quantized weights; use engine = \"ddp\" with "
                       f"quantizer '{plan.quantizer.name}'")
        return out

    def axis_problems(self) -> list[str]:
        """The sequence, context, tensor and pipeline axes against the processes and the engine."""
        out = [f"pp_size: {PIPELINE_WHY}"] if self.pp_size > 1 else []
        if self.sp_size > 1 and self.cp_size > 1:  # what else is wrong depends on which one stays
            return [*out, "cp_size: sequence parallelism (sp_size) and context parallelism (cp_size) both split "
                          "the rows; accelerate runs one of them at a time, so keep one above 1"]
        for key, engine, why in AXIS_ENGINES:
            if getattr(self, key) > 1 and self.engine != engine:
                out.append(f"{key}: {why}; set engine = \"{engine}\" (engine is \"{self.engine}\")")
        if self.tp_size > 1 and (self.processes != self.tp_size or self.engine != "ddp"):
            out.append(f"tp_size: tensor parallelism here splits every layer over all the processes (accelerate "
                       f"runs it beside neither DDP nor DeepSpeed); use nproc_per_node = {self.tp_size} with "
                       "engine = \"ddp\"")
        from ftcore_plugins.common.memory import gpu_visible

        if not gpu_visible():  # the libraries' own checks, before a run would reach them
            out += [f"{key}: {why}" for key, why in CUDA_ONLY.items() if getattr(self, key) > 1]
        if self.accelerate_config is None and self.processes % self.model_parallel:
            axes = " x ".join(f"{k} {getattr(self, k)}" for k in ("sp_size", "cp_size", "tp_size")
                              if getattr(self, k) > 1)
            out.append(f"nproc_per_node: {self.processes} process(es) cannot be split into groups of {axes} = "
                       f"{self.model_parallel}; use a multiple of {self.model_parallel}")
        return out

    def model_problems(self, config: dict[str, Any], attention: str | None = None) -> list[str]:
        """Why the model (its ``config.json`` as a dict, and the plan's ``attn_implementation``) cannot be
        split along the plan's axes: heads that do not divide (Ulysses hands each process whole heads, tensor
        parallelism whole heads' weights), recurrent layers (a state that runs along the row, which a slice of
        the row cannot start from), or an attention kernel the axis does not wrap. Keys start each message."""
        if self.processes == 1:
            return []
        out = []
        heads = config.get("num_attention_heads")
        kv = config.get("num_key_value_heads") or heads
        layers = config.get("layer_types") or config.get("layers_block_type") or []
        recurrent = sorted({t for t in layers if any(word in t for word in RECURRENT_LAYERS)})
        for key, size in (("sp_size", self.sp_size), ("tp_size", self.tp_size)):
            if size == 1 or not isinstance(heads, int):
                continue
            if heads % size:
                out.append(f"{key}: the model's {heads} attention heads do not divide by {size} (each process takes "
                           f"whole heads); use {key} = a divisor of {heads}")
            elif isinstance(kv, int) and kv % size and (key == "tp_size" or size % kv):
                out.append(f"{key}: the model's {kv} key/value heads and {size} do not divide "
                           f"{'one another' if key == 'sp_size' else 'evenly'} (each process takes whole key/value "
                           f"heads); use {'a divisor or a multiple' if key == 'sp_size' else 'a divisor'} of {kv}")
        for key, size in (("sp_size", self.sp_size), ("cp_size", self.cp_size)):
            if size > 1 and recurrent:
                out.append(f"{key}: the model's {', '.join(recurrent)} layers carry a state along the row, which a "
                           "slice of the row cannot start without (each process would restart it from zero, and the "
                           f"gradients would be wrong without an error); set {key} = 1")
        if self.sp_size > 1 and attention in ULYSSES_REFUSES:
            out.append(f"sp_size: attention \"{attention}\" is not one Ulysses wraps (accelerate refuses it); "
                       "use attn_implementation = \"sdpa\" or a flash attention kernel")
        if self.cp_size > 1:
            if attention not in (None, "sdpa"):
                out.append(f"cp_size: context parallelism shards SDPA's attention only (transformers refuses "
                           f"\"{attention}\"); use attn_implementation = \"sdpa\"")
            if "sliding_attention" in layers or config.get("sliding_window") and config.get("use_sliding_window", True):
                out.append("cp_size: the model's sliding-window attention is refused by accelerate's context "
                           "parallelism (its ring attention is causal over the whole row); use sp_size")
        return out

    def resolved_backend(self) -> str:
        import torch

        return self.backend if self.backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")


# -- the launcher ------------------------------------------------------------------------------
def is_worker() -> bool:
    """A process a launcher (ours, torchrun or accelerate) started: it runs the plan itself."""
    return LAUNCH_DIR in os.environ or "LOCAL_RANK" in os.environ


def launcher_command(d: Distributed, argv: list[str]) -> list[str]:
    """``torchrun`` (or ``accelerate launch`` for an accelerate config) re-running ``ftcore`` with ``argv``."""
    if d.accelerate_config is not None:
        return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(d.accelerate_config),
                "--num_machines", str(d.nnodes), "--machine_rank", str(d.node_rank),
                "--main_process_ip", d.master_addr, "--main_process_port", str(d.master_port),
                "-m", WORKER, *argv]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(d.nproc_per_node),
           "--nnodes", str(d.nnodes)]
    if d.rdzv_endpoint:
        cmd += ["--rdzv-backend", d.rdzv_backend, "--rdzv-endpoint", d.rdzv_endpoint]
        if d.rdzv_backend == "static":
            cmd += ["--node-rank", str(d.node_rank)]
    else:
        cmd += ["--node-rank", str(d.node_rank), "--master-addr", d.master_addr, "--master-port", str(d.master_port)]
    return [*cmd, "-m", WORKER, *argv]


def launch(d: Distributed, argv: list[str]) -> int:
    """Run ``ftcore argv`` in ``d.processes`` workers and return the run's exit code: the lowest rank's
    non-zero code (2 bad input, 1 a component failed, 130/143 a signal), else 0. SIGINT and SIGTERM
    are forwarded once to the launcher, which passes them to the workers (they stop at a step boundary
    with a checkpoint). If this process dies, the launcher and the workers die with it."""
    with tempfile.TemporaryDirectory(prefix="ftcore-launch-") as folder:
        env = {**os.environ, LAUNCH_DIR: folder, "PYTHONUNBUFFERED": "1"}
        # A session of its own: a Ctrl-C reaches the workers once, through us, not also from the terminal.
        proc = subprocess.Popen(launcher_command(d, argv), env=env, start_new_session=True,
                                preexec_fn=_die_with_parent)
        previous = {sig: signal.signal(sig, lambda signum, frame: proc.send_signal(signum))
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            code = proc.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        first = d.node_rank * d.nproc_per_node  # the global ranks on this node (static rendezvous)
        return _collect(Path(folder), code, range(first, first + d.nproc_per_node)
                        if d.accelerate_config is None and d.rdzv_backend == "static" else range(0))


def _collect(folder: Path, launcher_code: int, ranks: range) -> int:
    codes = {int(p.name[5:]): int(p.read_text() or 1) for p in folder.glob("exit-*")}
    failed = sorted(rank for rank, code in codes.items() if code)
    if not failed and launcher_code == 0:
        return 0
    # A rank that left no exit code crashed (the launcher then stopped the others): show its stderr.
    # Rank 0 printed its own error on the console.
    crashed = [r for r in ranks if r not in codes]
    # A rank above 0 that failed on its own (its error went to its log) while rank 0 was stopped for it.
    alone = [r for r in failed if r > 0 and codes[r] not in STOPPED and codes.get(0, 0) in (0, *STOPPED)]
    for rank in alone[:1]:
        log = folder / f"rank-{rank}.log"
        errors = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("error:")] \
            if log.exists() else []
        if errors:
            print(f"rank {rank}: {errors[-1]}", file=sys.stderr)
            return codes[rank]
    for rank in crashed:
        log = folder / f"rank-{rank}.log"
        tail = log.read_text(errors="replace").strip().splitlines()[-15:] if log.exists() else []
        print(f"error: rank {rank} crashed" + ("; the end of its stderr:" if tail else ""), *tail, sep="\n",
              file=sys.stderr)
    if crashed:
        return 1
    return codes[failed[0]] if failed else (launcher_code if launcher_code > 0 else 128 - launcher_code)


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent dies, so no worker outlives a killed run."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: workers end when their collectives fail
        pass


# -- in a worker -------------------------------------------------------------------------------
def start_worker(d: Distributed | None) -> None:
    """Set up a worker process: quiet ranks above 0, and the process group (so the runner can share
    rank 0's run-directory decision before anything is read)."""
    rank = int(os.environ.get("RANK", "0"))
    if LAUNCH_DIR in os.environ:
        _die_with_parent()
        if os.getppid() == 1:  # the launcher died before we got here
            os._exit(137)
    if rank > 0:
        _quiet(rank)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            backend = (d or Distributed()).resolved_backend()
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
                backend = "cuda:nccl,cpu:gloo"  # as accelerate does: FSDP gathers full state dicts on the CPU
            dist.init_process_group(backend)


def _quiet(rank: int) -> None:
    """Ranks above 0 print nothing: stdout is dropped, and stderr (warnings, library logs, progress
    bars) goes to a file the launcher shows only if this rank fails on its own."""
    import warnings

    os.environ.update(TRANSFORMERS_VERBOSITY="error", DATASETS_VERBOSITY="error", TQDM_DISABLE="1",
                      HF_DATASETS_DISABLE_PROGRESS_BARS="1", ACCELERATE_LOG_LEVEL="error")
    warnings.simplefilter("ignore")
    sys.stdout.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    folder = os.environ.get(LAUNCH_DIR)
    if folder:
        sys.stderr.flush()
        log = os.open(Path(folder) / f"rank-{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(log, 2)


def record_exit(code: int) -> None:
    """A worker's exit code, for the launcher (torchrun itself only says that some worker failed)."""
    folder = os.environ.get(LAUNCH_DIR)
    if folder:
        (Path(folder) / f"exit-{os.environ.get('RANK', '0')}").write_text(str(code))


def from_main(fn: Any, world_size: int) -> Any:
    """Run ``fn`` on rank 0 alone and give every rank its result, or raise its ``FtcoreError`` on every
    rank (a refused run directory stops all workers, not only the one that checked)."""
    from ftcore.errors import FtcoreError

    if world_size == 1:
        return fn()
    import torch.distributed as dist

    outcome: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            outcome = [("ok", fn())]
        except BaseException as exc:  # the others wait for word from rank 0: never leave them hanging
            dist.broadcast_object_list([("error", str(exc) or type(exc).__name__)], src=0)
            raise
    dist.broadcast_object_list(outcome, src=0)
    kind, value = outcome[0]
    if kind == "error":
        raise FtcoreError(value)
    return value


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


if __name__ == "__main__":  # a worker: `ftcore <argv>`, and how this rank ended for our launcher
    from ftcore.cli import main

    exit_code = main(sys.argv[1:])
    record_exit(exit_code)
    raise SystemExit(exit_code)
