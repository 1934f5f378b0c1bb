"""Train a flow-matching text-to-image model with the GRPO family.

    accelerate launch flowgrpo/train.py [CONFIG.yaml] [dotted.key=value ...]
    python flowgrpo/train.py --help          # every config field with its default and description

With no config the embedded default runs: the digits task (a small FLUX-architecture model that draws
handwritten digits, pretrained and cached on first use) with the digit-correctness reward.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable, drop flowgrpo/ from the path
    _here = Path(__file__).resolve().parent
    sys.path = [p for p in sys.path if Path(p or ".").resolve() != _here]
    sys.path.insert(0, str(_here.parent))

logger = logging.getLogger("flowgrpo.train")
DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "digits.yaml"
_SETUP_DONE = False  # set once the run is built: errors after it are bugs and keep their traceback


def _help_text() -> str:
    from flowgrpo.config import describe_fields

    rows = describe_fields()
    width = max(len(r[0]) for r in rows)
    lines = [f"  {k:<{width}}  {d}  [default: {v}]" for k, v, d in rows]
    return "config fields (set in YAML or as dotted.key=value):\n" + "\n".join(lines)


def build_rewards(specs):
    """(ComposedReward, origins) for a list of RewardSpec; None for an empty list."""
    from flowgrpo.rewards.compose import ComposedReward
    from flowgrpo.rewards.registry import load_reward

    if not specs:
        return None, []
    rewards, weights, origins = {}, {}, []
    for spec in specs:
        reward, origin = load_reward(spec.name, **spec.kwargs)
        key = spec.name.split(":")[-1]
        rewards[key] = reward
        weights[key] = spec.weight
        origins.append(origin)
    return ComposedReward(rewards, weights), origins


def check_strategies(config):
    """Let the chunker check its settings against the sampling settings, before any model or data is loaded (a
    mistake must not cost a model load and an evaluation; registered names are checked by the schema itself).
    Returns the chunker."""
    from flowgrpo.algo.chunkers import build_chunker
    from flowgrpo.algo.losses import POLICY_LOSSES, check_config

    check_config(POLICY_LOSSES.get(config.algo.policy_loss), config)
    chunker = build_chunker(config.chunker)
    chunker.validate(config.sampling.num_steps, config.sampling.sde_kind)
    return chunker


def run(config) -> dict:
    """Build every part from ``config`` and train; returns the summary."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from flowgrpo.data.prompts import load_prompts
    from flowgrpo.models import load_model
    from flowgrpo.models.lora import setup_trainable
    from flowgrpo.trainer import Trainer

    chunker = check_strategies(config)
    accelerator = Accelerator(log_with=config.logging.trackers or None, project_dir=config.output_dir)
    set_seed(config.train.seed)
    m = config.model
    adapter = load_model(m.pretrained, dtype=m.dtype, height=m.height, width=m.width,
                         max_sequence_length=m.max_sequence_length, cfg_detach_uncond=m.cfg_detach_uncond,
                         scheduler_shift=m.scheduler_shift)
    adapter.pipe.to(accelerator.device)
    params = setup_trainable(
        adapter, finetune=m.finetune, rank=m.lora_rank, alpha=m.lora_alpha, target_modules=m.lora_target_modules,
        need_reference=config.algo.kl_beta > 0, gradient_checkpointing=m.gradient_checkpointing,
    )
    if m.finetune == "lora":  # LoRA weights train in float32 whatever the model's dtype
        for p in params:
            p.data = p.data.float()
    rewards, origins = build_rewards(config.rewards)
    for name, reward in rewards.rewards.items():
        if getattr(reward, "eval_only", False):
            raise ValueError(f"reward {name!r} is for evaluation only (an independent judge): list it under "
                             "eval_rewards, not rewards")
    eval_rewards, eval_origins = build_rewards(config.eval_rewards)
    for r in (rewards, eval_rewards):
        if r is not None:
            r.setup(accelerator.device)
    prompts = load_prompts(config.data.train_prompts)
    _warn_benchmark_overlap(prompts)
    eval_prompts = load_prompts(config.data.eval_prompts) if config.data.eval_prompts else None
    if accelerator.trackers is not None and config.logging.trackers:
        accelerator.init_trackers("flowgrpo", config=_flat(config.model_dump(mode="json")))
    trainer = Trainer(config, adapter=adapter, params=params, rewards=rewards, eval_rewards=eval_rewards,
                      chunker=chunker, prompts=prompts, eval_prompts=eval_prompts,
                      accelerator=accelerator, reward_origins=origins + eval_origins)
    torch.set_grad_enabled(True)
    global _SETUP_DONE
    _SETUP_DONE = True
    summary = trainer.fit()
    accelerator.end_training()
    return summary


def _warn_benchmark_overlap(prompts) -> None:
    """Warn when training prompts overlap GenEval's evaluation prompts (training on them inflates the score)."""
    try:
        from flowgrpo_rewards.geneval.prompts import check_overlap
    except ImportError:  # the rewards distribution is not installed: nothing to compare against
        return
    records = [{"prompt": p, **m} for p, m in zip(prompts.prompts, prompts.metadata, strict=True)]
    overlap = check_overlap(records)
    if overlap:
        logger.warning("%d training prompts of %r overlap GenEval's evaluation set (e.g. %r): scores on GenEval "
                       "will be inflated", len(overlap), prompts.source, overlap[0])


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, int | float | str | bool) else str(v)
    return out


def _quiet_libraries() -> None:
    """Keep the console for our metrics: silence the libraries' per-call notices (truncated prompts, loading
    bars, deprecations), not their errors."""
    import warnings

    import diffusers
    import transformers

    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning, module="diffusers")


def print_summary(summary: dict) -> None:
    """The before/after table of the evaluation figures (and reference figures such as real-data diversity)."""
    metrics = sorted({k.rsplit("_", 1)[0] for k in summary if k.endswith(("_before", "_after"))})
    if not metrics:
        return
    refs = [k for k in summary if k.endswith("_real")]
    width = max(len(m) for m in metrics + refs)

    def cell(v) -> str:
        return f"{v:>10.4f}" if isinstance(v, float | int) else f"{'-':>10}"

    lines = [f"{'metric':<{width}}  {'before':>10}  {'after':>10}"]
    lines += [f"{m:<{width}}  {cell(summary.get(f'{m}_before'))}  {cell(summary.get(f'{m}_after'))}" for m in metrics]
    lines += [f"{r:<{width}}  {cell(summary[r])}  {cell(summary[r])}" for r in refs]
    print("\n".join(lines))  # noqa: T201 - the script's result table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, epilog=_help_text(), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config", nargs="?", help="YAML config (omit for the embedded digits default)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    args = parser.parse_args(argv)
    if args.config and "=" in args.config and not args.config.endswith((".yaml", ".yml")):
        args.overrides.insert(0, args.config)
        args.config = None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    _quiet_libraries()
    from flowgrpo.checkpoint import CheckpointError
    from flowgrpo.config import ConfigError, load_config
    from flowgrpo.rewards.base import MissingWeightsError
    from flowgrpo.rewards.registry import RewardLoadError

    try:
        config = load_config(args.config or DEFAULT_CONFIG, args.overrides)
        summary = run(config)
    except (ConfigError, RewardLoadError, CheckpointError, FileExistsError, MissingWeightsError) as err:
        parser.exit(2, f"error: {err}\n")
    except (KeyError, ValueError) as err:
        if not _SETUP_DONE:  # bad input found while setting up (names, prompt files, models): no traceback
            parser.exit(2, f"error: {err.args[0] if isinstance(err, KeyError) else err}\n")
        raise
    print_summary(summary)


if __name__ == "__main__":
    main()
