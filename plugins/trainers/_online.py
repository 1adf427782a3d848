"""What the online RL trainers (``grpo``, ``rloo``) share: options and their checks, prompts from the
stage's rows, the plan's reward functions and reward model as TRL reward functions, the reference
model, and the reward metrics."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from ftcore.errors import FtcoreError
from ftcore.types import LearningRate, RewardRef, StageRef

from ftcore_plugins.trainers._training import TrainOptions, run_trainer, training_problems

START_END_SHARE = 4  # reward_start / reward_end average the first / last quarter of the generation batches


class OnlineOptions(TrainOptions):
    reward: list[RewardRef] = []  # [reward.<name>] functions
    reward_model: StageRef | None = None  # an earlier stage whose output is a sequence-classification model
    reward_weights: list[float] | None = None  # one per source: reward in order, then reward_model; default 1.0
    num_generations: int = Field(8, ge=2)  # completions sampled per prompt, compared with each other
    max_completion_length: int = Field(256, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # 0: no top-k filtering
    num_iterations: int = Field(1, ge=1)  # optimisation passes over each generation batch
    epsilon: float = Field(0.2, gt=0)  # clipping of the policy ratio
    epsilon_high: float | None = Field(None, gt=0)  # upper clip (default: epsilon)
    mask_truncated_completions: bool = False  # leave completions cut at max_completion_length out of the loss
    learning_rate: LearningRate = 1e-6  # TRL's default for online RL
    logging_steps: int = Field(1, ge=1)  # the mean reward of every step
    # The policy loss hovers around 0 with either sign: no spikes to watch for unless asked.
    guard_spike_factor: float | None = Field(None, gt=1)


def check_online(component: Any, plan: Any) -> list[str]:
    """``ftcore validate``'s checks of a grpo/rloo stage: a reward source, the weights, whole groups."""
    o, name = component.options, component.name
    problems = training_problems(component, plan)
    for key in ("early_stopping_patience", "load_best_at_end"):
        if getattr(o, key):
            problems.append(f"{key}: trainer '{name}' has no eval_loss that says which checkpoint is better (its "
                            "loss is a policy-gradient surrogate); compare eval_reward across checkpoints instead")
    sources = len(o.reward) + (o.reward_model is not None)
    if not sources:
        problems.append(f"reward: trainer '{name}' needs a reward source: reward = [\"<name>\"] naming "
                        "[reward.<name>] tables, and/or reward_model = \"<stage>\" naming an earlier reward stage")
    elif o.reward_weights is not None and len(o.reward_weights) != sources:
        problems.append(f"reward_weights: {len(o.reward_weights)} weight(s) for {sources} reward source(s) "
                        "(reward in order, then reward_model); give one weight per source")
    group = o.batch_size * o.gradient_accumulation_steps
    if group % o.num_generations:
        problems.append(f"batch_size: batch_size x gradient_accumulation_steps = {o.batch_size} x "
                        f"{o.gradient_accumulation_steps} = {group} completions per generation batch must be a "
                        f"multiple of num_generations ({o.num_generations}): each prompt's {o.num_generations} "
                        "completions are scored against each other, so a batch holds whole groups")
    stage = next((s for s in plan.stages if s.trainer.options is o), None)
    if stage is not None and stage.eval_data and o.batch_size % o.num_generations:
        problems.append(f"batch_size: with eval_data, batch_size ({o.batch_size}) must be a multiple of "
                        f"num_generations ({o.num_generations}): evaluation generates whole groups per batch")
    if o.max_completion_length >= o.max_length:
        problems.append(f"max_completion_length: {o.max_completion_length} leaves no room for the prompt within "
                        f"max_length ({o.max_length}), which bounds prompt + completion")
    return problems


def train_online(component: Any, ctx: Any, trainer_cls: type, config_cls: type,
                 config: dict[str, Any]) -> dict[str, Any]:
    """Train ``ctx.model`` with TRL's ``trainer_cls`` (GRPOTrainer, RLOOTrainer) on the stage's prompts,
    scored by the plan's reward functions and reward model. ``config`` adds trainer-specific fields."""
    import copy

    from peft import PeftModel

    o = component.options
    train = prompt_dataset(ctx, component.name, ctx.train_data, "train", o)
    evaluation = prompt_dataset(ctx, component.name, ctx.eval_data, "eval", o)
    funcs = reward_functions(ctx, o)
    config = dict(num_generations=o.num_generations, max_completion_length=o.max_completion_length,
                  temperature=o.temperature, top_p=o.top_p, top_k=o.top_k, num_iterations=o.num_iterations,
                  epsilon=o.epsilon, epsilon_high=o.epsilon_high,
                  mask_truncated_completions=o.mask_truncated_completions, reward_weights=o.reward_weights,
                  **config)
    # The KL term compares with the policy as this stage got it. TRL builds that reference itself only
    # for a peft model (a copy of the adapter); for a full model it would reload model.config's path.
    reference = None
    if config["beta"] and not isinstance(ctx.model, PeftModel):
        reference = copy.deepcopy(ctx.model).eval().requires_grad_(False)
    trainer, metrics = run_trainer(ctx, o, online_trainer_class(trainer_cls), config_cls, train=train,
                                   evaluation=evaluation, config=config, reward_funcs=funcs, reference=reference)
    if isinstance(ctx.model, PeftModel) and "ref" in ctx.model.peft_config:
        ctx.model.delete_adapter("ref")  # TRL's frozen reference copy: not part of the stage's adapter
    metrics.pop("eval_perplexity", None)  # exp of a policy-gradient loss is no perplexity
    evals = [h for h in trainer.state.log_history if "eval_reward/mean" in h]
    if evals:
        metrics["eval_reward"] = evals[-1]["eval_reward/mean"]  # mean reward of the last evaluation's samples
    summary = reward_summary(trainer)
    if summary:
        ctx.reporter.info(f"stage [bold]{ctx.stage}[/]: mean reward {summary['reward_start']:.4f} over the first "
                          f"{summary['reward_window']} generation batch(es) -> {summary['reward_end']:.4f} over "
                          f"the last {summary['reward_window']} (of {summary['generation_batches']})")
    return {**metrics, **summary}


# -- prompts -------------------------------------------------------------------------------------

def prompt_dataset(ctx: Any, trainer: str, rows: Any, label: str, o: OnlineOptions) -> Any:
    """``{"prompt": text}`` rows: each conversation without its last assistant turn, rendered with the
    plan's chat template and its generation prompt (plain text, so TRL applies no chat template of its
    own); prompt/completion rows give their prompt. Prompts that leave no room for
    ``max_completion_length`` within ``max_length`` are dropped and counted."""
    import datasets

    from ftcore_plugins.common.chat import prompt_rows, prompt_text

    if rows is None:
        return None
    prompt_rows(rows, ctx.stage, trainer, label)
    tok = ctx.tokenizer
    # TRL tokenizes text prompts with the tokenizer's special tokens: leave out a BOS it adds itself.
    bos = tok.bos_token if adds_bos(tok) else None
    texts, empty = [], 0
    for row in rows:
        prompt = prompt_text(row, tok, ctx.template)
        if not prompt:
            empty += 1
            continue
        texts.append(prompt[len(bos):] if bos and prompt.startswith(bos) else prompt)
    limit = o.max_length - o.max_completion_length
    lengths = [len(ids) for ids in tok(texts)["input_ids"]] if texts else []
    kept = [t for t, n in zip(texts, lengths) if n <= limit]
    kept_lengths = sorted(n for n in lengths if n <= limit)
    stats = {"rows": len(rows), "kept": len(kept), "dropped_empty": empty,
             "dropped_too_long": len(texts) - len(kept), "max_prompt_tokens": limit}
    if kept_lengths:
        stats.update(prompt_tokens_p50=kept_lengths[len(kept_lengths) // 2], prompt_tokens_max=kept_lengths[-1])
    ctx.reporter.data_report(f"{ctx.stage}/{label}", stats)
    ctx.reporter.log(ctx.stage, {f"data/{label}_{k}": v for k, v in stats.items()})
    if not kept:
        raise FtcoreError(f"stage {ctx.stage}: no {label} prompt is left: {empty} empty, {len(texts)} longer than "
                          f"max_length - max_completion_length = {limit} tokens; raise max_length")
    if len(kept) < len(texts):
        ctx.reporter.warn(f"stage {ctx.stage}: dropped {len(texts) - len(kept)} {label} prompt(s) longer than "
                          f"{limit} tokens (max_length - max_completion_length)")
    return datasets.Dataset.from_dict({"prompt": kept})


def adds_bos(tokenizer: Any) -> bool:
    """Whether tokenizing text with special tokens puts a BOS in front of it."""
    return tokenizer.bos_token_id is not None and tokenizer("x")["input_ids"][:1] == [tokenizer.bos_token_id]


# -- rewards -------------------------------------------------------------------------------------

class PlanReward:
    """A plan's ``[reward.<name>]`` as a TRL reward function; TRL names its metrics after ``__name__``."""

    def __init__(self, name: str, component: Any, stage: str):
        self.__name__, self.component, self.stage = name, component, stage

    def __call__(self, prompts: list[str], completions: list[str], **_: Any) -> list[float | None]:
        scores = list(self.component.score(list(prompts), list(completions)))
        if len(scores) != len(completions):
            raise FtcoreError(f"stage {self.stage}: reward '{self.__name__}' returned {len(scores)} scores for "
                              f"{len(completions)} completions; score() must return one per completion")
        return [None if s is None else float(s) for s in scores]


class RewardModel:
    """An earlier stage's sequence-classification model as a TRL reward function: it scores the prompt,
    the completion and, for a completion that ended on its own, the template's end of turn, as the
    reward trainer saw whole conversations."""

    def __init__(self, stage: str, path: Any, ctx: Any):
        from accelerate import PartialState

        from ftcore_plugins.common import reward_model as _reward_model

        self.__name__ = stage
        self.device = PartialState().device  # where the Trainer puts the policy
        self.model, self.tokenizer = _reward_model.load(path, self.device, ctx.stage, stage)
        marker = "\x00"
        whole = ctx.template.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": marker}],
                                    ctx.tokenizer, add_generation_prompt=False)
        # As the reward trainer renders answers: up to and including the end-of-turn token.
        self.turn_end = whole[whole.index(marker) + 1:].rstrip("\n ")
        tok = ctx.tokenizer  # the policy saw each prompt with the BOS its tokenizer adds; so does the scorer
        self.bos = tok.bos_token if adds_bos(tok) else ""
        eos = getattr(ctx.model.generation_config, "eos_token_id", None)
        self.stops = set([eos] if isinstance(eos, int) else (eos or [])) | {ctx.tokenizer.eos_token_id}

    def __call__(self, prompts: list[str], completions: list[str], completion_ids: list[list[int]],
                 **_: Any) -> list[float]:
        from ftcore_plugins.common import reward_model as _reward_model

        texts = [self.bos + p + c + (self.turn_end if ids and ids[-1] in self.stops else "")
                 for p, c, ids in zip(prompts, completions, completion_ids)]
        return _reward_model.scores(self.model, self.tokenizer, texts, self.device)


def reward_functions(ctx: Any, o: OnlineOptions) -> list[Any]:
    funcs: list[Any] = []
    for name in o.reward:
        if name not in ctx.rewards:
            raise FtcoreError(f"stage {ctx.stage}: reward {name!r} is not defined; define it as [reward.{name}]")
        funcs.append(PlanReward(name, ctx.rewards[name], ctx.stage))
    if o.reward_model is not None:
        if o.reward_model not in ctx.outputs:
            raise FtcoreError(f"stage {ctx.stage}: reward_model {o.reward_model!r} names no earlier stage")
        funcs.append(RewardModel(o.reward_model, ctx.outputs[o.reward_model], ctx))
    return funcs


# -- the trainer and its metrics -----------------------------------------------------------------

def online_trainer_class(base: type) -> type:
    """``base`` (GRPOTrainer, RLOOTrainer) that takes its KL reference model as given, records every
    generation batch's rewards, and logs them as ``reward/mean`` and ``reward/<function>``."""

    class OnlineTrainer(base):
        def __init__(self, *args: Any, reference: Any = None, **kwargs: Any):
            config = kwargs["args"]
            beta = config.beta
            if reference is not None:
                config.beta = 0.0  # TRL would build its own reference from model.config's path
            super().__init__(*args, **kwargs)
            self.reward_batches: list[dict[str, tuple[float, int]]] = []  # per batch: name -> (sum, count)
            self.kl_values: list[float] = []
            if reference is not None:
                from trl.trainer.utils import add_fused_lm_head, disable_dropout_in_model

                config.beta = self.beta = beta
                if config.disable_dropout:
                    disable_dropout_in_model(reference)
                add_fused_lm_head(reference, temperature=self.temperature,
                                  cast_lm_head_to_fp32=getattr(config, "cast_lm_head_to_fp32", False))
                self.ref_model = self.accelerator.prepare_model(reference, evaluation_mode=True)

        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            import torch

            per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            if self.model.training:
                unscorable = torch.isnan(per_func).all(dim=1)
                total = (per_func * self.reward_weights.to(per_func.device)).nansum(dim=1)[~unscorable]
                batch = {"reward": (total.sum().item(), total.numel())}
                for i, name in enumerate(self.reward_func_names):
                    scored = per_func[:, i][~torch.isnan(per_func[:, i])]
                    batch[name] = (scored.sum().item(), scored.numel())
                self.reward_batches.append(batch)
            return per_func

        def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
            metrics = self._metrics["train" if self.model.training else "eval"]
            if self.model.training:
                self.kl_values += metrics.get("kl", [])
            renames = {"reward": "reward/mean", "reward_std": "reward/std"}
            for name in self.reward_func_names:
                renames.update({f"rewards/{name}/mean": f"reward/{name}", f"rewards/{name}/std": f"reward/{name}_std"})
            for old, new in renames.items():
                if old in metrics:
                    metrics[new] = metrics.pop(old)
            super().log(logs, start_time)

    OnlineTrainer.__name__ = OnlineTrainer.__qualname__ = base.__name__
    return OnlineTrainer


def reward_summary(trainer: Any) -> dict[str, Any]:
    """Mean reward per completion over the first and the last quarter of the generation batches this run
    trained on (and per reward function), and the KL to the reference over the same spans of steps."""
    batches = trainer.reward_batches
    if not batches:
        return {}
    k = max(1, len(batches) // START_END_SHARE)

    def mean(span: list[dict[str, tuple[float, int]]], key: str) -> float | None:
        count = sum(b[key][1] for b in span)
        return sum(b[key][0] for b in span) / count if count else None

    out: dict[str, Any] = {"reward_start": mean(batches[:k], "reward"), "reward_end": mean(batches[-k:], "reward"),
                           "reward_mean": mean(batches, "reward"), "reward_window": k,
                           "generation_batches": len(batches)}
    if out["reward_start"] is not None and out["reward_end"] is not None:
        out["reward_gain"] = out["reward_end"] - out["reward_start"]
    if len(trainer.reward_func_names) > 1:
        for name in trainer.reward_func_names:
            out[f"reward_start/{name}"] = mean(batches[:k], name)
            out[f"reward_end/{name}"] = mean(batches[-k:], name)
    kl = trainer.kl_values
    if kl:
        span = max(1, len(kl) // START_END_SHARE)
        out["kl_start"] = sum(kl[:span]) / span
        out["kl_end"] = sum(kl[-span:]) / span
    return out
