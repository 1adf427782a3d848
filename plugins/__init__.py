"""ftcore's built-in plugins: one folder per kind of component, one module per component.

They register through the same hooks as any third-party plugin. The core loads the modules this
package lists, by module path: ``COMPONENTS`` (``ftcore.plugins.BUILTIN_PLUGINS``) for ``ftcore
plugins``, ``validate`` and ``run``, and ``COMMANDS`` (``BUILTIN_COMMANDS``), which ``ftcore --help``
imports too. In each folder, modules whose names start with an underscore are helpers that only
that kind uses; ``common/`` holds what several kinds share. Heavy libraries are imported inside
methods, so listing plugins stays fast.
"""

import logging

# torchao (which transformers and peft import where it is installed) logs the CUDA-only extensions it lacks, and
# torch its enums, as they import: a user's one-line error must stay one line. Set before any of them loads.
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)

# One module per component (or plan section), registered by module path.
COMPONENTS = (
    "ftcore_plugins.models.hf",
    "ftcore_plugins.models.scratch",
    "ftcore_plugins.models.preflight",
    "ftcore_plugins.data.jsonl",
    "ftcore_plugins.data.json",
    "ftcore_plugins.data.csv",
    "ftcore_plugins.data.parquet",
    "ftcore_plugins.data.text",
    "ftcore_plugins.data.arrow",
    "ftcore_plugins.data.hf",
    "ftcore_plugins.data.mix",
    "ftcore_plugins.templates.chatml",
    "ftcore_plugins.templates.native",
    "ftcore_plugins.templates.llama2",
    "ftcore_plugins.templates.llama3",
    "ftcore_plugins.templates.mistral",
    "ftcore_plugins.templates.gemma",
    "ftcore_plugins.templates.phi3",
    "ftcore_plugins.templates.qwen25",
    "ftcore_plugins.templates.qwen3",
    "ftcore_plugins.templates.llama31",
    "ftcore_plugins.templates.mistral_v3",
    "ftcore_plugins.templates.tekken",
    "ftcore_plugins.templates.gemma3",
    "ftcore_plugins.templates.phi4",
    "ftcore_plugins.templates.deepseek_r1",
    "ftcore_plugins.templates.gpt_oss",
    "ftcore_plugins.templates.alpaca",
    "ftcore_plugins.templates.vicuna",
    "ftcore_plugins.templates.zephyr",
    "ftcore_plugins.templates.jinja",
    "ftcore_plugins.adapters.lora",
    "ftcore_plugins.adapters.dora",
    "ftcore_plugins.adapters.rslora",
    "ftcore_plugins.adapters.pissa",
    "ftcore_plugins.adapters.olora",
    "ftcore_plugins.adapters.loftq",
    "ftcore_plugins.adapters.loraplus",
    "ftcore_plugins.adapters.ia3",
    "ftcore_plugins.adapters.prompt_tuning",
    "ftcore_plugins.adapters.prefix_tuning",
    "ftcore_plugins.adapters.full",
    "ftcore_plugins.adapters.freeze",
    "ftcore_plugins.quantizers.none",
    "ftcore_plugins.quantizers.bnb_nf4",
    "ftcore_plugins.quantizers.bnb_fp4",
    "ftcore_plugins.quantizers.bnb_int8",
    "ftcore_plugins.quantizers.hqq",
    "ftcore_plugins.quantizers.torchao",
    "ftcore_plugins.quantizers.quanto",
    "ftcore_plugins.quantizers.fp8",
    "ftcore_plugins.trainers.sft",
    "ftcore_plugins.trainers.pretrain",
    "ftcore_plugins.evaluators.perplexity",
    "ftcore_plugins.evaluators.exact_match",
    "ftcore_plugins.evaluators.compare",
    "ftcore_plugins.evaluators.forgetting",
    "ftcore_plugins.evaluators.preference",
    "ftcore_plugins.exporters.adapter",
    "ftcore_plugins.exporters.merged",
    "ftcore_plugins.rewards.contains",
    "ftcore_plugins.rewards.regex",
    "ftcore_plugins.trainers.grpo",
    "ftcore_plugins.trainers.rloo",
    "ftcore_plugins.trainers.ppo",
    "ftcore_plugins.trackers.tensorboard",
    "ftcore_plugins.trackers.mlflow",
    "ftcore_plugins.trackers.wandb",
    "ftcore_plugins.trackers.track",
    "ftcore_plugins.trainers.dpo",
    "ftcore_plugins.trainers.kto",
    "ftcore_plugins.trainers.orpo",
    "ftcore_plugins.trainers.reward",
    "ftcore_plugins.trainers.distributed",
    "ftcore_plugins.evaluators.generation",
    "ftcore_plugins.evaluators.lm_eval",
    "ftcore_plugins.exporters.onnx",
    "ftcore_plugins.exporters.gguf",
    "ftcore_plugins.exporters.torchao",
    "ftcore_plugins.exporters.autoround",
    "ftcore_plugins.exporters.mlflow",
)

# Subcommands beyond run; `ftcore --help` imports these and no other built-in.
COMMANDS = (
    "ftcore_plugins.commands.validate",
    "ftcore_plugins.commands.plugins",
    "ftcore_plugins.commands.quiet",
    "ftcore_plugins.commands.init",
    "ftcore_plugins.commands.estimate",
    "ftcore_plugins.commands.report",
    "ftcore_plugins.commands.cache",
    "ftcore_plugins.commands.prepare",
    "ftcore_plugins.commands.check",
    "ftcore_plugins.commands.lr_find",
    "ftcore_plugins.commands.sweep",
    "ftcore_plugins.commands.chat",
    "ftcore_plugins.commands.generate",
)

# Each folder's prefix in the flat layout before 0.2, so FTCORE_DISABLE_PLUGINS=eval_perplexity still works.
FLAT_PREFIX = {"models": "model_", "data": "data_", "templates": "template_", "adapters": "adapter_",
               "quantizers": "quantizer_", "trainers": "trainer_", "evaluators": "eval_", "exporters": "export_",
               "trackers": "tracker_", "rewards": "reward_", "commands": "command_"}


def names(module_name: str) -> set[str]:
    """The names ``FTCORE_DISABLE_PLUGINS`` matches for a built-in module: its path
    (``ftcore_plugins.evaluators.perplexity``), the path in the package (``evaluators.perplexity``)
    and the flat name it had before (``eval_perplexity``)."""
    inner = module_name.removeprefix("ftcore_plugins.")
    folder, _, stem = inner.rpartition(".")
    return {module_name, inner, FLAT_PREFIX.get(folder, "") + stem}
