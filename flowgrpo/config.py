"""The typed training configuration: YAML is only data, this schema is the contract.

``load_config(path, overrides)`` reads a YAML file, applies dotted ``key=value`` overrides (values parsed as YAML,
so ``train.lr=1e-4`` is a float), validates every field, derives the batch sizes, and raises
:class:`ConfigError` with the offending key, what is allowed, and the closest valid key for a typo.
"""

from __future__ import annotations

import copy
import difflib
import types
import typing
import warnings
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializeAsAny,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError


class ConfigError(ValueError):
    """A configuration that cannot run: unknown key, wrong type, or impossible combination."""


def _takes_int(ann) -> bool:
    """Whether a field annotation admits an integer but not a boolean: ``int``, ``int | None``, ``Literal[0, 1]``."""
    if ann is int:
        return True
    args = typing.get_args(ann)
    if typing.get_origin(ann) is Literal:
        return any(type(a) is int for a in args) and not any(isinstance(a, bool) for a in args)
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        return bool not in args and any(_takes_int(a) for a in args)
    return False


def _takes_float(ann) -> bool:
    """Whether a field annotation admits a float but not a boolean: ``float``, ``float | None``."""
    if ann is float:
        return True
    args = typing.get_args(ann)
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        return bool not in args and any(_takes_float(a) for a in args)
    return False


def _bool_for_int(ann, value, takes=_takes_int) -> bool:
    """Whether ``value`` puts a boolean where ``ann`` wants an integer (``takes``: :func:`_takes_float` for a
    float): the value itself, or an item of a list or tuple field (``list[int]``, ``tuple[float, float]``)."""
    if isinstance(value, bool):
        return takes(ann)
    if not isinstance(value, list | tuple):
        return False
    options = typing.get_args(ann) if typing.get_origin(ann) in (typing.Union, types.UnionType) else (ann,)
    items = [a for o in options if typing.get_origin(o) in (list, tuple, set, frozenset) for a in typing.get_args(o)]
    return any(_bool_for_int(a, v, takes) for a in items for v in value)


class Section(BaseModel):
    """A config section: unknown keys are errors, assignments are validated, and a boolean is never taken for an
    integer or a float (pydantic's lax mode would read ``true`` as 1 and 1.0)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=(), allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_int(cls, value, info):
        """Raises ``PydanticCustomError`` (type ``bool_not_int`` or ``bool_not_float``, located at the field) for a
        boolean given to an integer or float field (or as an item of a list or tuple of them); every other value
        passes unchanged."""
        field = cls.model_fields.get(info.field_name) if info.field_name else None
        if field is not None and _bool_for_int(field.annotation, value):
            raise PydanticCustomError("bool_not_int", "an integer is needed, got a boolean; write the number itself")
        if field is not None and _bool_for_int(field.annotation, value, _takes_float):
            raise PydanticCustomError("bool_not_float", "a number is needed, got a boolean; write the number itself")
        return value


class ModelConfig(Section):
    """Which model to train and how."""

    pretrained: str = Field(
        "digits",
        description="diffusers folder or hub id (FLUX.1 or SD3.5), or an embedded model: 'digits' (built and "
        "cached on first use) or 'tiny' (random weights, for plumbing tests)",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype of the transformer's weights and forward; SDE arithmetic is always float32"
    )
    height: int | None = Field(
        None, ge=1, description="image height in pixels (default, null: the pipeline's sample size)"
    )
    width: int | None = Field(
        None, ge=1, description="image width in pixels (default, null: the pipeline's sample size)"
    )
    max_sequence_length: int = Field(
        512, ge=1, le=4096, description="text-encoder tokens per prompt (FLUX.1 / SD3: T5, at most 512; Qwen-Image "
        "family: up to 1024); longer prompts are truncated with a warning"
    )
    finetune: Literal["lora", "full"] = Field("lora", description="train a LoRA adapter or all transformer weights")
    lora_rank: int = Field(8, ge=1, description="LoRA rank r")
    lora_alpha: float = Field(16.0, gt=0, description="LoRA alpha (scale = alpha / r)")
    lora_target_modules: list[str] = Field(
        default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"],
        description="module names (peft target_modules) that receive LoRA",
    )
    gradient_checkpointing: bool = Field(False, description="recompute activations in the backward pass")
    attention_backend: Literal["auto", "flash", "efficient", "math", "cudnn"] = Field(
        "auto", description="SDPA kernels of the transformer in rollout and training (torch sdpa_kernel); 'auto' "
        "lets torch choose but never cuDNN on CUDA (its backward fails on some torch/cuDNN versions); 'math' "
        "always works",
    )
    scheduler_shift: float | None = Field(
        None, gt=0, description="static timestep shift s (sigma' = s*sigma/(1+(s-1)*sigma)) in place of the "
        "scheduler's own (FLUX: resolution-dependent); DanceGRPO and GCPO use 3 on FLUX.1-dev"
    )
    cfg_detach_uncond: bool = Field(
        False, description="SD3 true CFG: unconditional branch without gradient (its own no-grad forward)"
    )


def registered_name(registry_path: str, key: str):
    """A ``str`` field type whose value must be registered in the registry at ``module:attr`` (imported on first
    validation); otherwise a ValueError naming ``key`` with the registry's own message (valid names, closest)."""

    def check(name: str) -> str:
        import importlib

        module, attr = registry_path.split(":")
        try:
            getattr(importlib.import_module(module), attr).get(name)
        except KeyError as err:
            raise ValueError(f"{key}: {err.args[0]}") from None
        return name

    return Annotated[str, AfterValidator(check)]


SdeKindName = registered_name("flowgrpo.sampling.sde:SDE_KINDS", "sampling.sde_kind")
EstimatorName = registered_name("flowgrpo.algo.advantages:ESTIMATORS", "algo.advantage")
PolicyLossName = registered_name("flowgrpo.algo.losses:POLICY_LOSSES", "algo.policy_loss")
GroupFilterName = registered_name("flowgrpo.algo.filters:GROUP_FILTERS", "algo.group_filter.name")
FinalDecodeName = registered_name("flowgrpo.sampling.rollout:FINAL_DECODES", "sampling.final_decode")
KlFormName = registered_name("flowgrpo.sampling.sde:KL_FORMS", "algo.kl_form")
SelectionName = registered_name("flowgrpo.algo.filters:SELECTIONS", "algo.group_filter.select")


def _refuse_unread(section: BaseModel, prefix: str, selector: str, readers: dict[str, tuple[str, ...]],
                   known: tuple[str, ...]) -> None:
    """A setting moved from its default that the selected built-in strategy does not read is an error naming the
    setting, its readers and the selection (a plugin strategy, not in ``known``, may read any of them).

    Raises ``ValueError``: nothing is silently ignored."""
    chosen = getattr(section, selector)
    if chosen not in known:
        return
    for key, owners in readers.items():
        value, default = getattr(section, key), type(section).model_fields[key].default
        if chosen not in owners and value != default:
            raise ValueError(
                f"{prefix}.{key}={value!r} is read only by {prefix}.{selector}={' / '.join(owners)}, but "
                f"{prefix}.{selector} is {chosen!r}: remove the setting (default {default!r}) or choose "
                f"{' / '.join(owners)}")


class SamplingConfig(Section):
    """How trajectories are sampled for training."""

    num_steps: int = Field(10, ge=1, description="T, denoising steps per trajectory")
    guidance_scale: float = Field(3.5, ge=0, description="FLUX guidance embedding / SD3 CFG scale")
    sde_kind: SdeKindName = Field("flow_sde", description="registered SDE kind: flow_sde, dance_sde, cps, ode")
    noise_level: float = Field(
        0.7, ge=0, description="SDE noise: a for flow_sde and cps (cps: in [0, 1]), eta for dance_sde"
    )
    logprob_reduction: Literal["mean", "sum"] = Field("mean", description="reduce log-probs over latent dims")
    cps_simplified_logprob: bool = Field(
        False, description="CPS reference code's -(x-mean)^2 surrogate log-prob (needs a ~1e-5 clip range)"
    )
    same_noise_in_group: bool = Field(False, description="all G samples of a group start from one initial noise")
    sigma_one_guard: Literal["grid", "next"] = Field(
        "grid", description="flow_sde at sigma = 1, where s = a*sqrt(sigma/(1-sigma)) is infinite: 1-sigma uses the "
        "grid's second sigma (grid: the releases' sigma_max = sigmas[1]) or the transition's sigma_next (next); "
        "they differ only on a merged jump from sigma = 1 (E-GRPO)"
    )
    final_decode: FinalDecodeName = Field(
        "sample", description="latents decoded into the rewarded image: sample (the last SDE sample, Flow-GRPO) or "
        "x0_pred (x - sigma*v predicted at the last step, DanceGRPO/GCPO/MixGRPO/E-GRPO)"
    )


class EvalSamplingConfig(Section):
    """How images are sampled for evaluation (ODE: no noise)."""

    num_steps: int = Field(40, ge=1, description="denoising steps for evaluation images")
    guidance_scale: float = Field(3.5, ge=0, description="guidance for evaluation images")


class GroupFilterConfig(Section):
    """Which samples of each group enter the advantages (GFPO: sample more, keep the best; pass_rate: train only
    the groups of intermediate difficulty)."""

    name: GroupFilterName = Field(
        "none", description="registered group filter (flowgrpo.algo.filters.GROUP_FILTERS): none; gfpo (Group "
        "Filtered Policy Optimization, arXiv 2508.09726: sample train.group_size = G' per prompt, keep `keep`); "
        "pass_rate (online difficulty filtering, arXiv 2504.03380: train a group only if the fraction of its "
        "samples with metric >= pass_threshold is within [min_pass_rate, max_pass_rate])"
    )
    keep: int | None = Field(None, ge=2, description="gfpo: G, samples kept per group (< train.group_size)")
    metric: str = Field(
        "total", description="gfpo, pass_rate: what ranks or passes the samples: 'total' (the composed reward) or "
        "a reward's name (add a reward used only for filtering with weight 0)"
    )
    select: SelectionName = Field(
        "top", description="gfpo: registered selection (flowgrpo.algo.filters.SELECTIONS): top (highest metric), "
        "bottom (lowest, e.g. a cost), max_spread (the subset of largest metric variance, PODS arXiv 2504.13818)"
    )
    pass_threshold: float | None = Field(
        None, description="pass_rate: a sample passes when its metric is >= this (e.g. a capped reward's cap)"
    )
    min_pass_rate: float = Field(0.0, ge=0, le=1, description="pass_rate: groups passing less often are dropped")
    max_pass_rate: float = Field(1.0, ge=0, le=1, description="pass_rate: groups passing more often are dropped")

    @model_validator(mode="after")
    def _check(self) -> GroupFilterConfig:
        if self.name == "gfpo" and self.keep is None:
            raise ValueError("algo.group_filter.keep is needed for the filter 'gfpo'")
        if self.name == "pass_rate" and self.pass_threshold is None:
            raise ValueError("algo.group_filter.pass_threshold is needed for the filter 'pass_rate'")
        if self.min_pass_rate > self.max_pass_rate:
            raise ValueError(f"algo.group_filter.min_pass_rate={self.min_pass_rate} exceeds max_pass_rate="
                             f"{self.max_pass_rate}: no group could train")
        pr = ("pass_rate",)
        _refuse_unread(self, "algo.group_filter", "name",
                       {"keep": ("gfpo",), "select": ("gfpo",), "metric": ("gfpo", "pass_rate"),
                        "pass_threshold": pr, "min_pass_rate": pr, "max_pass_rate": pr},
                       known=("none", "gfpo", "pass_rate"))
        return self


class AlgoConfig(Section):
    """Advantages and the policy loss."""

    advantage: EstimatorName = Field("grpo", description="registered estimator: grpo, dr_grpo, rloo")
    global_std: bool = Field(False, description="grpo: divide by the batch's std instead of each group's")
    multi_reward: Literal["sum_then_normalize", "gdpo", "normalize_then_sum"] = Field(
        "sum_then_normalize", description="several rewards: weighted sum first; gdpo (each normalised in its group, "
        "weighted sum, renormalised over the batch); or normalize_then_sum (gdpo without the batch renormalisation, "
        "MixGRPO's advantage_aggr)"
    )
    advantage_clip: float = Field(5.0, gt=0, description="advantages clipped to +-this")
    drop_zero_spread_groups: bool = Field(False, description="leave groups with equal rewards out of the update")
    min_learning_frac: float = Field(
        0.1, ge=0, le=1, description="warn (console and metric adv/low_signal) when the fraction of samples with a "
        "learning signal (valid reward, group with spread) falls below this; 0: never"
    )
    clip_range: float = Field(1e-4, gt=0, description="epsilon of the clipped surrogate (both sides)")
    clip_range_low: float | None = Field(None, gt=0, description="epsilon_low (default clip_range)")
    clip_range_high: float | None = Field(None, gt=0, description="epsilon_high (default clip_range)")
    kl_beta: float = Field(0.0, ge=0, description="beta of the KL to the reference policy on transition means")
    policy_loss: PolicyLossName = Field(
        "clipped", description="registered policy loss (flowgrpo.algo.losses.POLICY_LOSSES): clipped (PPO/Flow-GRPO), "
        "dual_clip (Ye et al. 2020, arXiv 1912.09729), sapo (arXiv 2511.20347), grpo_guard (arXiv 2510.22319)"
    )
    sapo_tau_pos: float = Field(
        1.0, gt=0, description="sapo: gate temperature for A > 0 (paper: 1.0 for LLM token ratios; flow-model "
        "ratios move ~1e-4 from 1, so a temperature near 1/clip_range gives a comparable trust region)"
    )
    sapo_tau_neg: float = Field(1.05, gt=0, description="sapo: gate temperature for A <= 0 (paper: 1.05)")
    dual_clip_c: float = Field(
        3.0, gt=1, description="dual_clip: lower bound c on the objective of negative-advantage pairs (paper: 3)"
    )
    grpo_guard_stats: Literal["micro_batch", "per_sample"] = Field(
        "micro_batch", description="grpo_guard: RatioNorm's mean-drift bias, noise scale and step weight from the "
        "micro-batch's trained pairs at each step, one shared value (the release) or from each pair's own"
    )
    group_filter: GroupFilterConfig = Field(default_factory=lambda: GroupFilterConfig())
    kl_form: KlFormName = Field(
        "flow_grpo", description="registered KL form: flow_grpo (Flow-GRPO's scripts: (mu-mu_ref)^2 / "
        "(2*std_dev_t^2), std_dev_t = a*sqrt(sigma/(1-sigma)), no dt) or gaussian (exact Gaussian KL with the "
        "transition std; 1/(sigma-sigma_next) times larger for flow_sde and dance_sde)"
    )
    std_ddof: Literal[0, 1] = Field(
        0, description="delta degrees of freedom of the advantage std: 0 population (Flow-GRPO), 1 unbiased "
        "(DanceGRPO, MixGRPO, GCPO, E-GRPO, GDPO)"
    )
    std_eps: float = Field(
        1e-4, gt=0, description="added to the advantage std: 1e-4 (Flow-GRPO, GDPO) or 1e-8 (DanceGRPO family)"
    )
    recompute_old_log_probs: bool = Field(
        False, description="recompute old log-probs with the training batch layout before the first update"
    )

    @model_validator(mode="after")
    def _check(self) -> AlgoConfig:
        _refuse_unread(self, "algo", "policy_loss", {"sapo_tau_pos": ("sapo",), "sapo_tau_neg": ("sapo",),
                                                     "dual_clip_c": ("dual_clip",),
                                                     "grpo_guard_stats": ("grpo_guard",)},
                       known=("clipped", "dual_clip", "sapo", "grpo_guard"))
        _refuse_unread(self, "algo", "advantage", {"global_std": ("grpo",)}, known=("grpo", "dr_grpo", "rloo"))
        return self


#: the largest seed numpy (and so accelerate's ``set_seed``) accepts
SEED_MAX = 2**32 - 1


class TrainConfig(Section):
    """The loop, batch sizes and optimiser."""

    num_epochs: int = Field(10, ge=1, description="epochs (rollout + update rounds)")
    prompts_per_epoch: int = Field(8, ge=1, description="P, prompts sampled per epoch (over all processes)")
    group_size: int = Field(4, ge=2, description="G, samples per prompt (a group needs G >= 2)")
    rollout_batch_size: int = Field(8, ge=1, description="trajectories per transformer call while sampling")
    train_batch_size: int | None = Field(
        None, ge=1, description="samples per training micro-batch, and the most transformer rows one training "
        "call holds (a micro-batch's chunks share calls up to it); default rollout_batch_size"
    )
    inner_epochs: int = Field(1, ge=1, description="passes over one rollout (passes after the first are off-policy)")
    optimizer_steps_per_epoch: int = Field(
        1, ge=1, description="optimizer steps per pass; each takes an equal share of the samples"
    )
    lr: float = Field(1e-4, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(1e-4, ge=0, description="AdamW weight decay")
    adam_betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas, each in [0, 1)")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping norm")
    warmup_steps: int = Field(0, ge=0, description="linear learning-rate warmup, in optimizer steps")
    seed: int = Field(
        0, description="seed of every random draw (prompts, noise, chunk sampling), in 0..2**32-1 (numpy's range)"
    )
    latents_on_cpu: bool = Field(
        False, description="keep rollout latents in CPU memory between phases (moved to the device per micro-batch)"
    )
    ema_decay: float | None = Field(
        None, ge=0, lt=1, description="EMA of the trained weights (e.g. 0.9), used for evaluation and saving"
    )
    resume_from: str | None = Field(
        None, description="checkpoint folder, or a checkpoints root holding 'latest', to resume from"
    )

    @field_validator("seed")
    @classmethod
    def _seed_range(cls, seed: int) -> int:
        """Raises ``ValueError`` naming ``train.seed`` for a seed outside 0..2**32-1 (numpy and accelerate's
        ``set_seed`` accept no other)."""
        if not 0 <= seed <= SEED_MAX:
            raise ValueError(f"train.seed={seed} is out of range: a seed must be an integer in 0..2**32-1 "
                             f"(0..{SEED_MAX})")
        return seed


class RewardSpec(Section):
    """One reward: a registered name (entry point) or 'module:attr', its weight and constructor kwargs."""

    name: str = Field(description="entry-point name in group flowgrpo.rewards, or 'module:attr'")
    weight: float = Field(
        1.0, description="weight w in the composed reward, the weighted sum Σ w·r (negative: a penalty)"
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the reward")


class DataConfig(Section):
    """Prompt files: plain text (one prompt a line) or JSONL (a 'prompt' field plus metadata)."""

    train_prompts: str = Field("digits", description="prompt file, or an embedded set: digits, t2i_compbench")
    eval_prompts: str | None = Field(None, description="held-out prompt file for periodic evaluation")
    eval_num_prompts: int = Field(200, ge=1, description="evaluation prompts (cycled with new seeds if fewer)")


class LoggingConfig(Section):
    """What is written where."""

    trackers: list[Literal["tensorboard", "wandb"]] = Field(default_factory=list, description="accelerate trackers")
    eval_every: int = Field(0, ge=0, description="evaluate every N epochs (0: only before and after)")
    save_every: int = Field(0, ge=0, description="checkpoint every N epochs (0: only at the end)")
    checkpoints_total_limit: int = Field(2, ge=1, description="newest checkpoints kept")
    overwrite: bool = Field(False, description="start a new run in an output_dir that holds an old one")
    progress: bool = Field(True, description="progress bars on the main process")
    plot_every: int = Field(
        1, ge=0, description="draw reward_curve.png and samples_latest.png every N epochs and after the last one "
        "(0: only after the last); matplotlib takes about half a second for the two"
    )
    save_rollout_stats: bool = Field(
        False, description="write each epoch's gathered rewards, advantages, group ids and initial noise to "
        "rollouts/epoch_<N>.safetensors (for analysis and the multi-process equivalence test)"
    )


def _chunker_settings(section: dict) -> Section:
    """Validate a ``chunker:`` section against the settings model of the strategy its ``name`` selects.

    Raises:
        ValueError: an unknown strategy (listing the registered ones) or a key the strategy does not have
            (naming the strategies that do, or the closest key).
    """
    from flowgrpo.algo.chunkers import CHUNKERS, chunker_config_class
    from flowgrpo.registry import did_you_mean

    name = section.get("name", "per_step")
    try:
        settings = chunker_config_class(name)
    except KeyError as err:
        raise ValueError(f"chunker.name: {err.args[0]}") from None
    for key in section:
        if key in settings.model_fields:
            continue
        owners = [n for n in CHUNKERS if key in chunker_config_class(n).model_fields]
        hint = (f"; it belongs to chunker {' / '.join(map(repr, owners))} (to switch strategies, replace the "
                f"whole section, e.g. 'chunker={{name: {name}}}', or 'chunker: {{name: {name}}}' in a config that "
                "extends another)" if owners
                else did_you_mean(key, settings.model_fields).replace(" (", "; ").rstrip(")"))
        raise ValueError(f"unknown config key 'chunker.{key}' for chunker {name!r} (its keys: "
                         f"{sorted(settings.model_fields)}){hint}")
    return settings.model_validate(section)


class Config(Section):
    """A whole training run."""

    output_dir: str = Field("runs/default", description="run folder: config, metrics, images, weights")
    model: ModelConfig = Field(default_factory=ModelConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    eval_sampling: EvalSamplingConfig = Field(default_factory=EvalSamplingConfig)
    chunker: SerializeAsAny[Section] = Field(
        default_factory=lambda: _chunker_settings({}), description="the chunker strategy and its own settings "
        "(one section per strategy; see flowgrpo.algo.chunkers)"
    )
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    rewards: list[RewardSpec] = Field(
        default_factory=lambda: [RewardSpec(name="digit_correctness")], description="rewards optimised"
    )
    eval_rewards: list[RewardSpec] = Field(
        default_factory=list, description="extra rewards scored at evaluation only (reward-hacking watch)"
    )
    data: DataConfig = Field(default_factory=DataConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)

    @field_validator("chunker", mode="before")
    @classmethod
    def _chunker_section(cls, value):
        return _chunker_settings(value) if isinstance(value, dict) else value

    @model_validator(mode="after")
    def _derive(self) -> Config:
        t = self.train
        b = t.prompts_per_epoch * t.group_size
        if b % t.rollout_batch_size:
            raise ValueError(
                f"train.rollout_batch_size={t.rollout_batch_size} must divide the batch "
                f"B = prompts_per_epoch*group_size = {b}"
            )
        tb = self.train_batch_size
        if b % tb:
            more = (f" (chunker {self.chunker.name!r} trains each sample as one trajectory per branch step; "
                    "train_batch_size must divide the samples, so that every micro-batch holds whole groups)"
                    if self.chunker.multiplies_batch else "")
            raise ValueError(f"train.train_batch_size={tb} must divide the batch B = prompts_per_epoch*group_size = "
                             f"{b}{more}")
        if (b // tb) % t.optimizer_steps_per_epoch and not self.chunker.multiplies_batch:
            raise ValueError(
                f"train.optimizer_steps_per_epoch={t.optimizer_steps_per_epoch} must divide the number of "
                f"training micro-batches B / train_batch_size = {b // tb}"
            )
        if not all(0 <= beta < 1 for beta in t.adam_betas):
            raise ValueError(f"train.adam_betas must each be in [0, 1), got {list(t.adam_betas)}")
        if not self.rewards:
            raise ValueError("rewards: at least one reward is needed")
        gf = self.algo.group_filter
        if gf.name == "gfpo" and gf.keep >= t.group_size:
            raise ValueError(f"algo.group_filter.keep={gf.keep} must be below train.group_size={t.group_size} "
                             "(the samples drawn per prompt)")
        keys = [r.name.split(":")[-1] for r in self.rewards]  # the names the composition gives the rewards
        if gf.name != "none" and gf.metric != "total" and gf.metric not in keys:
            raise ValueError(f"algo.group_filter.metric={gf.metric!r} is neither 'total' nor one of the rewards "
                             f"{keys}; add it to rewards with weight 0")
        if all(r.weight == 0 for r in self.rewards):
            raise ValueError("every reward in rewards has weight 0: the composed reward would be 0 and nothing "
                             "would be optimised; give at least one a weight")
        both = sorted({r.name for r in self.rewards} & {r.name for r in self.eval_rewards})
        if both:
            raise ValueError(f"rewards {both} are in both rewards and eval_rewards: a reward is either optimised "
                             "(rewards) or only scored at evaluation (eval_rewards)")
        names = [r.name for r in self.rewards + self.eval_rewards]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"rewards: each reward may appear once (in rewards or eval_rewards), repeated: {dup}")
        return self

    @property
    def batch_size(self) -> int:
        """B = P·G, trajectories per epoch over all processes."""
        return self.train.prompts_per_epoch * self.train.group_size

    @property
    def train_batch_size(self) -> int:
        return self.train.train_batch_size or self.train.rollout_batch_size

    @property
    def clip_low(self) -> float:
        return self.algo.clip_range_low if self.algo.clip_range_low is not None else self.algo.clip_range

    @property
    def clip_high(self) -> float:
        return self.algo.clip_range_high if self.algo.clip_range_high is not None else self.algo.clip_range


def _valid_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key of the schema; the fields of list items appear under the list's name."""
    keys = []
    for name, f in model.model_fields.items():
        keys.append(prefix + name)
        for ann in (f.annotation, *typing.get_args(f.annotation)):
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                keys += _valid_keys(ann, prefix + name + ".")
                break
    return keys


#: names other trainers (trl, diffusers scripts, Flow-GRPO, DanceGRPO) give to our keys: leaf -> our leaf
ALIASES = {
    "learning_rate": "lr", "lr_rate": "lr", "epochs": "num_epochs", "num_train_epochs": "num_epochs",
    "max_epochs": "num_epochs", "num_generations": "group_size", "num_images_per_prompt": "group_size",
    "group": "group_size", "batch_size": "rollout_batch_size", "sample_batch_size": "rollout_batch_size",
    "per_device_train_batch_size": "train_batch_size", "num_inference_steps": "num_steps",
    "sample_steps": "num_steps", "steps": "num_steps", "eta": "noise_level", "noise": "noise_level",
    "cfg": "guidance_scale", "cfg_scale": "guidance_scale", "guidance": "guidance_scale", "beta": "kl_beta",
    "kl_coef": "kl_beta", "kl": "kl_beta", "clip_epsilon": "clip_range", "epsilon": "clip_range",
    "clip_eps": "clip_range", "lora_r": "lora_rank", "rank": "lora_rank", "alpha": "lora_alpha",
    "model": "pretrained", "pretrained_model_name_or_path": "pretrained", "model_name": "pretrained",
    "resume": "resume_from", "resume_from_checkpoint": "resume_from", "output": "output_dir",
    "logdir": "output_dir", "save_dir": "output_dir", "grad_clip": "max_grad_norm", "clip_grad_norm": "max_grad_norm",
    "mixed_precision": "dtype", "precision": "dtype", "prompts": "train_prompts", "prompt_file": "train_prompts",
    "resolution": "height", "image_size": "height", "report_to": "trackers", "tracker": "trackers",
}


def _suggest(parent: str, leaf: str, valid: list[str]) -> str:
    """The closest valid dotted key for an unknown ``parent.leaf``: a known alias, a typo of a key of the same
    section, or the same leaf in another section."""
    prefix = parent + "." if parent else ""
    same = [k for k in valid if k.startswith(prefix) and "." not in k[len(prefix):]]
    target = ALIASES.get(leaf.lower())
    for name in ([target] if target else []) + [leaf]:
        if prefix + name in same:
            return prefix + name if name != leaf else ""
        elsewhere = [k for k in valid if k.rsplit(".", 1)[-1] == name]
        if elsewhere:
            return elsewhere[0]
    close = difflib.get_close_matches(prefix + leaf, same, n=1, cutoff=0.6)
    if close:
        return close[0]
    close = difflib.get_close_matches(leaf, [k.rsplit(".", 1)[-1] for k in valid], n=1, cutoff=0.6)
    return next((k for k in valid if close and k.rsplit(".", 1)[-1] == close[0]), "")


def _format_error(err: ValidationError) -> str:
    lines = []
    valid = _valid_keys(Config)
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":  # locations of list items carry their index: rewards.0.wieght
            leaf = str(e["loc"][-1])
            parent = ".".join(str(p) for p in e["loc"][:-1] if not isinstance(p, int))
            close = _suggest(parent, leaf, valid)
            hint = f"; did you mean {close!r}?" if close else ""
            lines.append(f"unknown config key {loc!r}{hint}")
        elif e["type"] == "value_error":
            lines.append(str(e["msg"]).removeprefix("Value error, "))
        else:
            lines.append(f"config field {loc!r}: {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``'a.b.c=value'`` → (['a', 'b', 'c'], YAML-parsed value). Raises :class:`ConfigError` without ``=``."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like dotted.key=value")
    key, value = text.split("=", 1)
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError as err:
        raise ConfigError(
            f"override {text!r}: the value is not valid YAML ({str(err).splitlines()[0]}); quote the whole "
            f"override for the shell, e.g. '{key}=[{{name: x}}]'"
        ) from None
    return key.strip().split("."), parsed


#: renamed top-level sections: old key -> new key (the old one still works, with a warning)
RENAMED_SECTIONS = {"grouper": "chunker"}


def _renamed(key: str, where: str) -> str:
    new = RENAMED_SECTIONS.get(key)
    if new is None:
        return key
    warnings.warn(f"{where}: the config section {key!r} is now called {new!r}; the old name will be removed",
                  FutureWarning, stacklevel=3)
    return new


def build_config(data: dict | None = None, overrides: list[str] = ()) -> Config:
    """Validate a config dict after applying dotted overrides. Raises :class:`ConfigError`.

    Renamed sections (:data:`RENAMED_SECTIONS`) are accepted under their old name with a ``FutureWarning``."""
    data = copy.deepcopy(data or {})
    for old in [k for k in data if k in RENAMED_SECTIONS]:
        new = _renamed(old, "config")
        if new in data:
            raise ConfigError(f"config has both {old!r} and its new name {new!r}; keep only {new!r}")
        data[new] = data.pop(old)
    for text in overrides:
        path, value = parse_override(text)
        path[0] = _renamed(path[0], f"override {text!r}")
        node = data
        for p in path[:-1]:
            if not isinstance(node.setdefault(p, {}), dict):
                raise ConfigError(f"override {text!r}: {p!r} is not a section")
            node = node[p]
        node[path[-1]] = value
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def read_yaml(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict:
    """A config file as a dict. A top-level ``base: OTHER.yaml`` (relative to the file) is read first and this
    file's keys are merged over it (sections merge key by key; lists and values replace). Raises
    :class:`ConfigError` for a missing file, a non-mapping, or a cycle of bases."""
    p = Path(path).resolve()
    if not p.is_file():
        hint = "" if p.suffix in (".yaml", ".yml") else (
            "; a config file ends in .yaml, and an override is dotted.key=value (e.g. train.num_epochs=20)")
        raise ConfigError(f"config file {str(path)!r} does not exist{hint}")
    if p in _seen:
        raise ConfigError(f"config file {str(p)!r} is its own base (cycle {[str(x) for x in _seen]})")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is not None:
        if not isinstance(base, str):
            raise ConfigError(f"config file {str(path)!r}: 'base' must be a file name, got {base!r}")
        data = _deep_merge(read_yaml(p.parent / base, (*_seen, p)), data)
    return data


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Read YAML ``path`` (or the defaults when None), apply overrides, validate. Raises :class:`ConfigError`."""
    return build_config(read_yaml(path) if path is not None else {}, overrides)


def save_config(config: Config, path: str | Path) -> None:
    """Write the resolved config as YAML (every field, defaults included)."""
    Path(path).write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))


def flat_dict(d: dict, prefix: str = "") -> dict:
    """A nested dict (a dumped config) as ``{"dotted.key": value}``; dicts are flattened, other values kept."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat_dict(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def describe_fields(model: type[BaseModel] = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, description) for every field, for ``--help``."""
    rows = []
    for name, f in model.model_fields.items():
        ann = f.annotation
        if model is Config and name == "chunker":
            rows += _describe_chunkers()
            continue
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows += describe_fields(ann, prefix + name + ".")
            continue
        default = f.default_factory() if f.default_factory is not None else f.default
        if isinstance(default, list) and default and isinstance(default[0], BaseModel):
            default = [d.model_dump() for d in default]
        rows.append((prefix + name, repr(default), f.description or ""))
    return rows


def _describe_chunkers() -> list[tuple[str, str, str]]:
    """``chunker.*`` rows: each strategy's own settings, marked with the strategies that have them."""
    from flowgrpo.algo.chunkers import CHUNKERS, chunker_config_class

    owners: dict[str, list[str]] = {}
    fields = {}
    for strategy in CHUNKERS:
        for key, f in chunker_config_class(strategy).model_fields.items():
            owners.setdefault(key, []).append(strategy)
            fields.setdefault(key, f)
    rows = []
    for key, f in fields.items():
        default = "'per_step'" if key == "name" else repr(f.default)
        where = "" if key == "name" else f"[{', '.join(owners[key])}] "
        text = f.description or (chunker_config_class("per_step").__mro__[2].model_fields[key].description or "")
        rows.append((f"chunker.{key}", default, where + text))
    return rows
