"""TDM-R1: reinforcement of a few-step generator with a non-differentiable reward, through a surrogate reward model
(``objective: {name: tdm_r1, teacher: FOLDER}``; Luo, Hu, Luo, Tang, "TDM-R1: Reinforcing Few-Step Diffusion
Models with Non-Differentiable Reward", arXiv 2603.07700; release Luo-Yihong/TDM-R1: ``scripts/train_tdmr1_pub.py``
read at commit 1ee7d9f, below "the script", and ``config/tdmr1_clean.py`` at 0c37f9f, "the config"; the script's
blocks are named by its own section comments, its line numbers were not readable here).

Four models, as the script's one transformer with three LoRA adapters: the **generator** (the trained model, the
script's ``tdm`` adapter, sampling in ``sampling.num_steps`` steps), the frozen **real score** (the teacher, the
script's base model with every adapter off; :mod:`~flowgrpo.algo.objectives.teacher_copies`), the **fake score**
(``fake``, TDM's online score of the generator's samples) and the **surrogate reward** (``dgpo``, a diffusion model
whose preference, learned from the reward's group advantages, is the reward the generator follows), with a **slow
surrogate** (``ema_old``) that trails it. The fake score and the surrogate start as the teacher. In the flow
convention ``x_σ = (1 − σ)·x₀ + σ·ε``, ``v = ε − x₀``, every x₀ prediction is ``x̂₀ = x_σ − σ·v``; σ is the
script's timestep / 1000.

**Rollout**: the generator's deterministic path σ₀ = 1 > … > σ_N = 0, every state x_j kept
(:func:`~flowgrpo.algo.objectives.paths.path_rollout`, Euler steps; the script samples with diffusers' DPM-Solver
multistep scheduler, ``flow_shift`` 3, ``noise_level`` 0); the final images scored by any reward (a 0/1 verdict,
OCR, GenEval) and the group advantages A computed as for every objective (the script: per-prompt mean, the
batch's std, ``global_std``).

**Times** (the script's ``convert``/``inv_convert`` with s = 3): shift(u) = 3u/(1 + 2u), unshift its inverse; for
a boundary j with next state σ_{j+1} and a floor f, ``τ = shift(u·(1 − lo) + lo)``, ``lo = unshift(max(σ_{j+1},
f)) + 0.02``, u ~ U[0, 1) one draw for the micro-batch (:func:`draw_time`). Per micro-batch M = ``num_train_timesteps``
distinct boundaries j are drawn (``random.sample``); for each: τ (f = 0: the fake score's and the TDM terms'),
τ_d (f = ``reward_time_floor``: the generator's surrogate query), and, for the surrogate's own update, a boundary
j′ drawn with probability ∝ j′ + 1 and its τ_s (f = ``surrogate_time_floor``).

**Re-noising a state forward** from σ_n to τ > σ_n (:func:`renoise`): ``α = (1 − τ)/(1 − σ_n)``, ``β = √(τ² −
(σ_n·α)²)``, ``x_τ = α·x + β·ε``.

**Fake score** ("TDM-Style Fake Score Training"), at boundary j: the generator's (no gradient) velocity at (x_j,
σ_j) gives x̂₀ and its Euler step ``x̂_{j+1} = x_j − (σ_j − σ_{j+1})·v``; ``x_τ = renoise(x̂_{j+1})``, target
``(x_τ − x̂₀)/τ``; ``L_fake = mean_dims((target − v_fake)²) + fake_reg·mean_dims((v_real − v_fake)²)``
(:func:`fake_loss`; fake_reg 0.02).

**Surrogate** ("DGPO-style Training of Surrogate Reward"), at boundary j′ on the rollout's own state x_{j′+1}
(σ_n = σ_{j′+1}), ε shared by a group: ``x_τ = renoise(x_{j′+1})`` at τ_s and the target (:func:`surrogate_target`,
the script's "η = 0" limit of its Eq. 9) ``−x/(1 − σ_n) + ε/β·(τ + σ_n²·α/(1 − σ_n))``; with e, e_old, e_ref the
mean_dims squared errors of the surrogate, the slow surrogate and the real score (:func:`surrogate_loss`):

    ρ = exp(e_old − e): a row stops its gradient where A > 0 and ρ > 1 + clip_range, or A ≤ 0 and ρ < 1 − clip_range
    reg = mean over the micro-batch of mean_dims((v_s − v_real)²); where reg > reference_threshold, a row whose
        ρ_ref = exp(e_ref − e) moved the way A asks (> 1 for A > 0, < 1 else) stops its gradient too
    s_g = Σ_{i ∈ g} A_i·β_dpo·(sg(e_i) − e_ref,i)/G  (all processes), w = sigmoid(s_g)
    L_s = t_w·(w·A·e + reference_beta·mean_dims((v_s − v_real)²)),  t_w = (j′ + 1)/N with time weighting

(DGPO's group preference, :func:`~flowgrpo.algo.objectives.dgpo.dgpo_group_sums`). After each surrogate step
``slow ← d·slow + (1 − d)·surrogate``, ``d = min(slow_decay_max, slow_decay_min + 0.001·k)``, k its steps before.

**Generator** ("TDM-R1 Training of few-step generator"), at boundary j with gradient through x̂₀ and x̂_{j+1}:
``x_τ = renoise(x̂_{j+1})`` at τ and ``x_τd = renoise(x̂_{j+1})`` at τ_d (ε_d shared by a group); without gradient
the fake score and the real score (conditional, and at ``real_guidance_scale``) at x_τ, the surrogate at
``surrogate_guidance_scale`` and the real score (conditional) at x_τd. Three directions on x̂₀ (:func:`generator_loss`):

    kl   = x̂₀^real,cond − x̂₀^fake                   (TDM's reverse-KL gradient)
    cfg  = c·(x̂₀^real,cond − x̂₀^real,uncond)         (guidance as a reward; c = cfg_reward_scale, 3.5)
    rwd  = x̂₀^surrogate − x̂₀^real,cond (at x_τd)     (the learned reward)
    L = w·m(cfg)/wf + (1 − w)·m(rwd)/wd + m(kl)/wf   for j < trunc_steps, else w·(m(cfg) + m(kl))/wf

with ``m(d) = mean_dims((sg(x̂₀ + d) − x̂₀)²)``, ``wf = mean_dims|x̂₀ − x̂₀^real|`` (the real score at its guidance),
``wd = mean_dims|x̂₀ − x̂₀^surrogate|``, w = ``tdm_weight``. The unconditional prediction is recovered from the
guided and the conditional ones: ``v_uncond = (g·v_cond − v_g)/(g − 1)``.

**Order** (the script's accumulation): every role's gradient of an iteration is taken at the weights the iteration
began with, then the three step (the script steps at the window's last micro-batch, whose generator and surrogate
terms alone see the fresh fake score). Here each iteration (a share of the micro-batches,
``train.optimizer_steps_per_epoch`` an epoch) runs the generator step first, keeping its detached x̂₀ and x̂_{j+1}
for the fake step, then the fake score's and the surrogate's steps: the same gradients for every micro-batch.
Each role's gradient is clipped on its own (the script clips the norm of all three adapters' gradients together).
Fidelity table: docs/fidelity_forward.md, "TDM-R1".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
from pydantic import Field, model_validator

from flowgrpo.algo.objectives.base import (
    CLIP_RANGE,
    OBJECTIVES,
    TEACHER,
    MicroBatchAt,
    ObjectiveConfig,
    UpdateStep,
    shared_field,
)
from flowgrpo.algo.objectives.dgpo import dgpo_clip_mask, dgpo_group_sums, shared_group_noise
from flowgrpo.algo.objectives.flow_matching import ObjectiveTerms, mean_dims, x0_from_velocity
from flowgrpo.algo.objectives.forward import ForwardObjective, ForwardWork, _Stats, sde_ratio_problems
from flowgrpo.algo.objectives.old_copy import update_old_copy_
from flowgrpo.algo.objectives.opd import check_teacher
from flowgrpo.algo.objectives.paths import EULER_PATH_INSTEAD, PathSamples, path_rollout
from flowgrpo.algo.objectives.teacher_copies import (
    copy_own_tensors,
    lora_copy,
    module_velocity,
    own_tensors,
    real_score,
    trainable_copy,
    trained_parameters,
)
from flowgrpo.distributed import dist
from flowgrpo.records import Advantages
from flowgrpo.rng import make_generator

__all__ = ["TDMR1", "TDMR1Config", "shift", "unshift", "draw_time", "renoise", "surrogate_target", "fake_loss",
           "surrogate_loss", "generator_loss", "boundary_weights"]

#: the script's time shift s of ``convert``/``inv_convert`` (fixed at 3 in every call) and the gap it leaves above
#: the next state's time (``+ 20`` on the 0–1000 scale)
SHIFT, GAP = 3.0, 0.02
#: the largest time floor that leaves a time to draw: unshift(floor) + GAP < 1
MAX_TIME_FLOOR = SHIFT * (1 - GAP) / (1 + (SHIFT - 1) * (1 - GAP))
#: the smallest real-score guidance from which the unconditional prediction is recovered,
#: (g·v_cond − v_g)/(g − 1): nearer 1 the division amplifies the two forwards' rounding
MIN_REAL_GUIDANCE = 1.5


def shift(u: torch.Tensor, s: float = SHIFT) -> torch.Tensor:
    """The script's ``convert`` on σ ∈ [0, 1]: ``s·u/(1 + (s − 1)·u)`` (the same shape)."""
    return s * u / (1 + (s - 1) * u)


def unshift(y: torch.Tensor, s: float = SHIFT) -> torch.Tensor:
    """The script's ``inv_convert`` on σ ∈ [0, 1]: ``y/(s − (s − 1)·y)``, the inverse of :func:`shift`."""
    return y / (s - (s - 1) * y)


def draw_time(u: float, sigma_next: float, floor: float = 0.0) -> float:
    """τ = max(shift(u·(1 − lo) + lo), b) with b = max(σ_{j+1}, floor) and lo = unshift(b) + 0.02 (module
    docstring), for u ∈ [0, 1). Raises ``ValueError`` when lo ≥ 1 (no time above the state to draw)."""
    bound = max(float(sigma_next), float(floor))
    lo = float(unshift(torch.tensor(bound, dtype=torch.float64))) + GAP
    if lo >= 1.0:
        raise ValueError(f"TDM-R1 draws a time above sigma={bound:.4f} (the next state's, or a time floor), but "
                         f"unshift(sigma) + {GAP} = {lo:.4f} leaves none below 1: lower the floor or use more steps")
    return max(float(shift(torch.tensor(u * (1 - lo) + lo, dtype=torch.float64))), bound)


def renoise(x: torch.Tensor, sigma: float, tau: float, noise: torch.Tensor) -> torch.Tensor:
    """``α·x + β·ε`` (x's shape, float32) with α = (1 − τ)/(1 − σ), β = √(τ² − (σ·α)²): the forward process from
    the state x at σ to τ > σ (module docstring)."""
    alpha = (1 - tau) / (1 - sigma)
    beta = (tau ** 2 - (sigma * alpha) ** 2) ** 0.5
    return alpha * x.float() + beta * noise.float()


def surrogate_target(x: torch.Tensor, sigma: float, tau: float, noise: torch.Tensor) -> torch.Tensor:
    """The surrogate's velocity target at :func:`renoise` (x, σ → τ, ε): ``−x/(1 − σ) + ε/β·(τ + σ²·α/(1 − σ))``
    (x's shape, float32); at σ = 0 it is flow matching's ``ε − x``."""
    alpha = (1 - tau) / (1 - sigma)
    beta = (tau ** 2 - (sigma * alpha) ** 2) ** 0.5
    return -x.float() / (1 - sigma) + noise.float() / beta * (tau + sigma ** 2 * alpha / (1 - sigma))


def fake_loss(v_fake: torch.Tensor, target: torch.Tensor, v_real: torch.Tensor, reg: float) -> torch.Tensor:
    """``mean_dims((target − v_fake)²) + reg·mean_dims((v_real − v_fake)²)`` (n,) float32, gradient through
    ``v_fake`` only."""
    v = v_fake.float()
    return mean_dims((target.detach().float() - v).square()) + reg * mean_dims((v_real.detach().float() - v).square())


def surrogate_loss(v: torch.Tensor, v_old: torch.Tensor, v_real: torch.Tensor, target: torch.Tensor,
                   advantages: torch.Tensor, group_index: torch.Tensor, num_groups: int, settings: TDMR1Config, *,
                   group_size: int, time_weight: float, reduce_group_sums=None) -> ObjectiveTerms:
    """The surrogate's loss L_s of a micro-batch's n rows (module docstring), float32.

    Args:
        v, v_old, v_real: (n, …) the surrogate's (with gradient), the slow surrogate's and the real score's
            velocity at x_τ. target: (n, …) :func:`surrogate_target`. advantages: (n,).
        group_index, num_groups: each row's group, numbered alike on every process. settings: the objective's.
        group_size: G. time_weight: t_w. reduce_group_sums: sums the group sums over the processes (None: one).

    Returns:
        ``loss`` (n,) and the detached stats ``fm_error`` (e), ``ref_fm_error`` (e_ref), ``group_weight``,
        ``clip_frac`` and ``ref_clip_frac`` (0/1: the row clipped against the slow copy, the real score),
        ``reg`` (mean_dims((v − v_real)²)).
    """
    adv = advantages.float().to(v.device)
    err = mean_dims((target.float() - v.float()).square())
    old_err = mean_dims((target.float() - v_old.float()).square())
    ref_err = mean_dims((target.float() - v_real.float()).square())
    _, clipped = dgpo_clip_mask(err, old_err, adv, settings.clip_range)
    err = torch.where(clipped, err.detach(), err)
    reg = mean_dims((v.float() - v_real.detach().float()).square())
    ref_ratio = torch.exp(ref_err - err.detach())
    moved = torch.where(adv > 0, ref_ratio > 1.0, ref_ratio < 1.0)
    ref_clipped = moved & (reg.detach().mean() > settings.reference_threshold)
    err = torch.where(ref_clipped, err.detach(), err)
    sums = dgpo_group_sums(err.detach() - ref_err, adv, group_index, num_groups, settings.beta_dpo, group_size)
    if reduce_group_sums is not None:
        sums = reduce_group_sums(sums)
    weight = torch.sigmoid(sums)[group_index.to(v.device)].detach()
    loss = time_weight * (weight * adv * err + settings.reference_beta * reg)
    return ObjectiveTerms(loss=loss, stats={"fm_error": err.detach(), "ref_fm_error": ref_err.detach(),
                                            "group_weight": weight, "clip_frac": clipped.float(),
                                            "ref_clip_frac": ref_clipped.float(), "reg": reg.detach()})


def _pull(x0: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
    """``mean_dims((sg(x̂₀ + d) − x̂₀)²)`` (n,): its gradient on x̂₀ is −2·d/D."""
    return mean_dims(((x0 + direction).detach() - x0).square())


def generator_loss(x0: torch.Tensor, kl: torch.Tensor, cfg: torch.Tensor, wf: torch.Tensor, settings: TDMR1Config,
                   reward: torch.Tensor | None = None, wd: torch.Tensor | None = None) -> ObjectiveTerms:
    """The generator's loss L of n rows (module docstring), float32, gradient through ``x0`` only.

    Args:
        x0: (n, …) x̂₀ with gradient. kl, cfg, reward: (n, …) the three directions (``cfg`` already scaled by
            ``cfg_reward_scale``; ``reward`` None past ``trunc_steps``). wf, wd: (n,) the weighting factors.
    """
    x0 = x0.float()
    m_kl, m_cfg = _pull(x0, kl.float()) / wf, _pull(x0, cfg.float()) / wf
    w = settings.tdm_weight
    if reward is None:
        loss = w * (m_cfg + m_kl)
        m_rwd = torch.zeros_like(m_kl)
    else:
        m_rwd = _pull(x0, reward.float()) / wd
        loss = w * m_cfg + (1 - w) * m_rwd + m_kl
    return ObjectiveTerms(loss=loss, stats={"kl_loss": m_kl.detach(), "cfg_loss": m_cfg.detach(),
                                            "reward_loss": m_rwd.detach(), "weighting": wf.detach()})


def boundary_weights(steps: int) -> torch.Tensor:
    """(steps,) float64 probabilities ∝ j + 1 of the surrogate's boundary j (the script's ``torch.arange(N) + 1``)."""
    w = torch.arange(steps, dtype=torch.float64) + 1
    return w / w.sum()


class TDMR1Config(ObjectiveConfig):
    """``objective: {name: tdm_r1, teacher: FOLDER, ...}``: TDM-R1 (module docstring) with the config's OCR preset
    (``general_ocr_sd3_8gpu_G24_4step`` over ``compressibility``) as defaults; the student's step count is
    ``sampling.num_steps`` (the preset's 4)."""

    name: Literal["tdm_r1"] = "tdm_r1"
    teacher: str | None = TEACHER
    num_train_timesteps: int = Field(2, ge=1, description="TDM-R1: boundaries trained per micro-batch, distinct, "
                                     "drawn from the student's steps (the config: 2)")
    trunc_steps: int = Field(4, ge=0, description="TDM-R1: boundaries j < trunc_steps follow the surrogate reward; "
                             "later ones only the TDM terms (OCR 4, HPS/ImageReward 2)")
    tdm_weight: float = Field(0.3, ge=0, le=1, description="TDM-R1: w, the guidance reward against the surrogate "
                              "reward (0.3)")
    cfg_reward_scale: float = Field(3.5, ge=0, description="TDM-R1: c of the guidance reward c*(cond - uncond) "
                                    "(the script's 3.5); 0: none (a model sampled without guidance)")
    real_guidance_scale: float = Field(4.5, ge=0, description="TDM-R1: the real score's guidance of the generator's "
                                       "weighting factor and unconditional prediction (the script's 4.5)")
    surrogate_guidance_scale: float = Field(4.5, ge=0, description="TDM-R1: the surrogate's guidance in the "
                                            "generator's reward (the config's rl_cfg: OCR 4.5, GenEval 2.5)")
    beta_dpo: float = Field(10.0, ge=0, description="TDM-R1: beta of the surrogate's group preference (OCR 10)")
    reference_beta: float = Field(0.001, ge=0, description="TDM-R1: weight of the surrogate's velocity distance to "
                                  "the real score (the config's train.beta: 0.001)")
    reference_threshold: float = Field(0.05, ge=0, description="TDM-R1: above this distance rows that moved the "
                                       "advantage's way stop their gradient (reg_threshold 0.05)")
    clip_range: float = shared_field(CLIP_RANGE, 1e-3)
    slow_decay_min: float = Field(0.001, ge=0, le=1, description="TDM-R1: the slow surrogate's first decay "
                                  "(ema_old_decay_min 0.001), + 0.001 a step")
    slow_decay_max: float = Field(0.3, ge=0, le=1, description="TDM-R1: the slow surrogate's largest decay (0.3)")
    reward_time_floor: float = Field(0.3, ge=0, lt=1, description="TDM-R1: the generator's surrogate query time "
                                     "is above this (t_min_dgpo/1000: OCR 0.3)")
    surrogate_time_floor: float = Field(0.3, ge=0, lt=1, description="TDM-R1: the surrogate's training time is "
                                        "above this (t_min_dgpo_reward/1000: OCR 0.3)")
    time_weighting: bool = Field(True, description="TDM-R1: the surrogate's loss weighted (j + 1)/N (use_tweight)")
    fake_reg: float = Field(0.02, ge=0, description="TDM-R1: weight of the fake score's distance to the real score "
                            "(the script's 0.02)")
    fake_lr: float | None = Field(None, gt=0, description="TDM-R1: the fake score's learning rate (the script's "
                                  "learning_rate, 4x the generator's); default 4 * train.lr")
    surrogate_lr: float | None = Field(None, gt=0, description="TDM-R1: the surrogate's learning rate (as the fake "
                                       "score's); default 4 * train.lr")
    surrogate_betas: tuple[float, float] = Field((0.9, 0.999), description="TDM-R1: the surrogate's AdamW betas "
                                                 "(rl_adam_beta1/2; the generator's, fake score's: train.adam_betas)")

    trains_on: ClassVar[str] = "the generator's own rollout path, a teacher, a fake score and a surrogate reward"
    instead: ClassVar[dict[tuple[str, str], str]] = EULER_PATH_INSTEAD

    @model_validator(mode="after")
    def _meaningful(self) -> TDMR1Config:
        if self.slow_decay_min > self.slow_decay_max:
            raise ValueError(f"objective.slow_decay_min={self.slow_decay_min} exceeds slow_decay_max="
                             f"{self.slow_decay_max}: the slow surrogate's decay grows from the first to the second")
        if self.cfg_reward_scale > 0 and self.real_guidance_scale < MIN_REAL_GUIDANCE:
            raise ValueError(f"objective.cfg_reward_scale={self.cfg_reward_scale} needs the real score's guidance "
                             f"objective.real_guidance_scale >= {MIN_REAL_GUIDANCE} (got {self.real_guidance_scale}): "
                             "the unconditional prediction is recovered dividing by its distance from 1 (the "
                             "release's 4.5); set cfg_reward_scale=0 for a model sampled without guidance")
        for name in ("reward_time_floor", "surrogate_time_floor"):
            if getattr(self, name) >= MAX_TIME_FLOOR:
                raise ValueError(f"objective.{name}={getattr(self, name)} leaves no time to draw above it: it must "
                                 f"be below {MAX_TIME_FLOOR:.4f} (shift(1 - {GAP}), the script's time draw)")
        if not all(0 <= b < 1 for b in self.surrogate_betas):
            raise ValueError(f"objective.surrogate_betas must each be in [0, 1), got {list(self.surrogate_betas)}")
        return self

    def problems(self, config) -> list[str]:
        """The SDE-ratio settings (:func:`~flowgrpo.algo.objectives.forward.sde_ratio_problems`), one line each."""
        return super().problems(config) + sde_ratio_problems(self, config)


@dataclass(frozen=True)
class TDMDraw:
    """One forward of a TDM-R1 step: ``kind`` (generator, fake or surrogate), the micro-batch's rows and global
    index ``mb``, the boundary ``step`` j (the surrogate's j′), ``tau`` (τ; the surrogate's τ_s), ``tau_reward``
    (τ_d) and the noises: ``noise`` (n, …) ε (the surrogate's shared by a group), ``reward_noise`` ε_d (the
    generator's, shared by a group; else None). Host tensors."""

    kind: str
    rows: torch.Tensor
    mb: int
    step: int
    boundary: int
    tau: float
    tau_reward: float
    noise: torch.Tensor
    reward_noise: torch.Tensor | None = None


@dataclass
class TDMState:
    """An update's statistics per role and the generator's detached (x̂₀, x̂_{j+1}) of each (micro-batch,
    boundary), which the same iteration's fake step trains on."""

    generator: _Stats = field(default_factory=_Stats)
    fake: _Stats = field(default_factory=_Stats)
    surrogate: _Stats = field(default_factory=_Stats)
    outputs: dict = field(default_factory=dict)


@OBJECTIVES.register("tdm_r1")
class TDMR1(ForwardObjective):
    """TDM-R1 (module docstring) on the forward family's plan: per iteration a generator, a fake-score and a
    surrogate step, M draws per micro-batch each; the fake score and the surrogate are stepped by their own
    :class:`~flowgrpo.training.optim.SecondOptimizer`, the slow surrogate follows the surrogate's steps."""

    Config = TDMR1Config
    uses_old_copy = False
    frozen_teacher = True  # the real score: a whole transformer on the device (the memory plan counts it)
    trains_teacher_copy = True  # the fake score: a whole trained copy with its AdamW (the memory plan counts it)
    surrogate_copies = True  # the surrogate (trained, AdamW) and its slow copy (the memory plan counts them)
    lora_copies = True  # under LoRA fine-tuning the three copies are LoRA adapters on the teacher (attach)

    def __init__(self, config) -> None:
        super().__init__(config)
        self.teacher = self.fake = self.fake_forward = self.fake_optim = None
        self.surrogate = self.surrogate_forward = self.surrogate_optim = None
        self.slow = self.slow_forward = None
        self.slow_decay = 0.0
        self.guidance_checked = False  # the guidance reward's teacher checked (its first forward)

    @property
    def needs_reference(self) -> bool:
        """The real score is the teacher (its own module), not the run's reference."""
        return False

    def validate(self) -> None:
        """One pass an update, micro-batches of whole groups (the group preference), the teacher folder's layout
        and family, before any model loads."""
        if self.cfg.train.inner_epochs != 1:
            raise ValueError(f"objective.name=tdm_r1 runs one pass an update (each iteration steps the generator, "
                             f"the fake score and the surrogate), got train.inner_epochs={self.cfg.train.inner_epochs}"
                             ": set it to 1")
        tb, g = self.cfg.train_batch_size, self.cfg.train.group_size
        if tb % g:
            raise ValueError(f"objective tdm_r1 sums the surrogate's preference over each group's rows in a "
                             f"micro-batch: train.train_batch_size={tb} must be a multiple of train.group_size={g}")
        if self.o.teacher:
            check_teacher(self.o.teacher, self.cfg.model)

    def trajectories_per_sample(self, sigmas: torch.Tensor, settings) -> int:
        """One path a sample; M ≤ N boundaries, and every boundary's times drawable (:func:`draw_time`)."""
        n = sigmas.numel() - 1
        if self.o.num_train_timesteps > n:
            raise ValueError(f"objective.num_train_timesteps={self.o.num_train_timesteps} distinct boundaries of a "
                             f"{n}-step student (sampling.num_steps): lower it to <= {n}")
        for j in range(n):
            if float(sigmas[j + 1]) >= MAX_TIME_FLOOR:
                raise ValueError(f"objective tdm_r1 draws its times above each step's next state, but the "
                                 f"{n}-step grid (sampling.num_steps={n}) has sigma={float(sigmas[j + 1]):.4f} after "
                                 f"step {j}, which leaves none below 1: use fewer sampling steps")
        self.check_whole_groups("sums the surrogate's preference over each group's rows")
        return 1

    def sigmas_per_sample(self, sigmas: torch.Tensor) -> int:
        return self.o.num_train_timesteps

    def attach(self, adapter, rewards) -> None:
        """The real score and the trained copies (:mod:`~flowgrpo.algo.objectives.teacher_copies`): the fake
        score and the surrogate with their AdamW (learning rate 4·``train.lr`` unless set: the script's generator
        runs at ``learning_rate / 4``); the slow surrogate, a frozen copy of the surrogate. Under ``model.finetune:
        lora`` the three are LoRA adapters of the model's rank, alpha and targets on the teacher's own (shared,
        frozen) weights, as the script's adapters (``lora_copy``); under ``full`` whole float32 copies of the
        teacher (``trainable_copy``)."""
        self.teacher = real_score(self.o.teacher, adapter, self.cfg.model)
        m = self.cfg.model
        if m.finetune == "lora":
            for name in ("fake", "surrogate", "slow"):
                module = lora_copy(self.teacher, m.lora_rank, m.lora_alpha, m.lora_target_modules)
                setattr(self, name, module)
                setattr(self, f"{name}_forward", module)
            copy_own_tensors(self.slow, self.surrogate)
        else:
            self.fake, self.fake_forward = trainable_copy(self.teacher, adapter.device)
            self.surrogate, self.surrogate_forward = trainable_copy(self.teacher, adapter.device)
            self.slow, self.slow_forward = trainable_copy(self.teacher, adapter.device)  # the surrogate as it starts
        self.slow.requires_grad_(False)
        lr = 4 * self.cfg.train.lr
        self.fake_optim = self.optim.second_optimizer(trained_parameters(self.fake), lr=self.o.fake_lr or lr)
        self.surrogate_optim = self.optim.second_optimizer(
            trained_parameters(self.surrogate), lr=self.o.surrogate_lr or lr, betas=self.o.surrogate_betas)
        self.surrogate_optim.on_step = self._follow

    @torch.no_grad()
    def _follow(self, steps_before: int) -> None:
        """slow ← d·slow + (1 − d)·surrogate, d = min(max, min + 0.001·k) (module docstring)."""
        self.slow_decay = min(self.o.slow_decay_max, self.o.slow_decay_min + 0.001 * steps_before)
        slow, surrogate = own_tensors(self.slow), own_tensors(self.surrogate)
        update_old_copy_(list(slow.values()), list(surrogate.values()), self.slow_decay)

    def rollout(self, adapter, request) -> PathSamples:
        """The generator's own Euler path (no gradient), every latent kept."""
        return path_rollout(adapter, request)

    def plan(self, samples: PathSamples, adv: Advantages, keep: torch.Tensor, epoch: int) -> ForwardWork:
        """The forward family's plan with every sample the group filter keeps trained (the script trains every
        sample; a zero advantage still trains the fake score and the TDM terms)."""
        return super().plan(samples, dataclasses.replace(adv, train_mask=torch.ones_like(adv.train_mask)), keep,
                            epoch)

    def plan_extra(self, samples: PathSamples, epoch: int) -> dict:
        """The groups' numbering over all processes (sorted: the same everywhere)."""
        groups = torch.unique(dist.gather_cat(samples.group_ids))
        return {"group_index": torch.searchsorted(groups, samples.group_ids), "num_groups": len(groups)}

    # ------------------------------------------------------------------ the update
    def update_steps(self, work: ForwardWork) -> list[UpdateStep]:
        """Each iteration (a share of the micro-batches): the generator's step, the fake score's, the
        surrogate's."""
        if self.fake_optim is None:
            raise RuntimeError("objective tdm_r1: attach(adapter, rewards) was not called before the update")
        out = []
        for share, rows in zip(work.steps, work.step_rows, strict=True):
            out.append(UpdateStep(("generator", share), rows, len(share)))
            out.append(UpdateStep(("fake", share), rows, len(share), optimizer=self.fake_optim))
            out.append(UpdateStep(("surrogate", share), rows, len(share), optimizer=self.surrogate_optim))
        return out

    def update_state(self, work: ForwardWork) -> TDMState:
        return TDMState()

    def micro_batches(self, work: ForwardWork, step: UpdateStep, inner: int) -> list[TDMDraw]:
        """The M draws of ``kind`` of each micro-batch of the step's share (:meth:`draws`)."""
        kind, share = step.plan
        return [d for rows in share for d in self.draws(work, rows, inner, kind)]

    def draws(self, work: ForwardWork, rows: torch.Tensor, inner: int, kind: str) -> list[TDMDraw]:
        """Micro-batch ``rows``'s M boundaries and their times (shared by its three kinds), and the ``kind``'s
        noises, seeded by (seed, epoch, pass, the global micro-batch, boundary) and, for a group's shared ε, by
        the group: the same on any number of processes."""
        s, seed = work.samples, self.cfg.train.seed
        n = s.sigmas.numel() - 1
        mb = work.micro_batch_index(rows)
        order = torch.randperm(n, generator=make_generator(seed, work.epoch, inner, "tdm_r1_steps", mb))
        out = []
        for j in order[: self.o.num_train_timesteps].tolist():
            g = make_generator(seed, work.epoch, inner, "tdm_r1_times", mb, j)
            u, u_d, u_s = torch.rand(3, generator=g, dtype=torch.float64).tolist()
            j_s = int(torch.multinomial(boundary_weights(n), 1, generator=g))
            sig = s.sigmas.double()
            if kind == "surrogate":
                tau = draw_time(u_s, float(sig[j_s + 1]), self.o.surrogate_time_floor)
                noise = self._group_noise(work, rows, inner, "tdm_r1_eps_surrogate", mb, j)
                out.append(TDMDraw(kind, rows, mb, j_s, j, tau, 0.0, noise))
                continue
            tau = draw_time(u, float(sig[j + 1]))
            tau_d = draw_time(u_d, float(sig[j + 1]), self.o.reward_time_floor)
            noise = torch.randn((len(rows), *s.x0.shape[1:]), generator=make_generator(
                seed, work.epoch, inner, f"tdm_r1_eps_{kind}", mb, j))
            shared = self._group_noise(work, rows, inner, "tdm_r1_eps_reward", mb, j) if kind == "generator" else None
            out.append(TDMDraw(kind, rows, mb, j, j, tau, tau_d, noise, shared))
        return out

    def _group_noise(self, work: ForwardWork, rows: torch.Tensor, inner: int, what: str, mb: int,
                     j: int) -> torch.Tensor:
        """ε (n, …) shared by the rows of a group (:func:`~flowgrpo.algo.objectives.dgpo.shared_group_noise`)."""
        s = work.samples
        gi = work.extra["group_index"][rows]
        gen = make_generator(self.cfg.train.seed, work.epoch, inner, what, mb, j)
        local, inverse = torch.unique(gi, return_inverse=True)
        return shared_group_noise(tuple(s.x0.shape[1:]), inverse, len(local), gen)

    # ------------------------------------------------------------------ the three losses
    def _generator_output(self, adapter, work: ForwardWork, d: TDMDraw, embeds, *, grad: bool):
        """(x̂₀, x̂_{j+1}) (n, …) float32 of the generator at its state x_j, at the rollout's guidance."""
        s, j, dev = work.samples, d.step, adapter.device
        x = s.latents[d.rows.to(s.latents.device), j].to(dev).float()
        sj, sn = float(s.sigmas[j]), float(s.sigmas[j + 1])
        with torch.set_grad_enabled(grad):
            v = self.velocity(adapter, x, torch.full((len(d.rows),), sj, device=dev), embeds,
                              guidance=s.guidance_scale)
            return x - sj * v.float(), x - (sj - sn) * v.float()

    def _real(self, adapter, x, tau, embeds) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The real score's (conditional, guided, unconditional) velocity at (x, τ); the unconditional one
        ``(g·v_cond − v_g)/(g − 1)`` (the conditional itself at g = 1)."""
        g = self.o.real_guidance_scale
        cond = module_velocity(adapter, self.teacher, x, tau, embeds, 1.0).float()
        if g == 1.0:
            return cond, cond, cond
        guided = module_velocity(adapter, self.teacher, x, tau, embeds, g).float()
        if self.o.cfg_reward_scale > 0 and not self.guidance_checked:  # once: torch.equal syncs the device
            self.guidance_checked = True
            self._check_guidance(cond, guided, g)
        return cond, guided, (g * cond - guided) / (g - 1)

    def _check_guidance(self, cond: torch.Tensor, guided: torch.Tensor, g: float) -> None:
        """Refuse the guidance reward when the teacher's velocity does not move with guidance (ValueError)."""
        if torch.equal(guided, cond):
            raise ValueError(f"objective.cfg_reward_scale={self.o.cfg_reward_scale}: the teacher's velocity does not "
                             f"change with guidance (real_guidance_scale={g} gives the conditional prediction: a model "
                             "sampled without guidance); set objective.cfg_reward_scale=0, real_guidance_scale=1 and "
                             "surrogate_guidance_scale=1")

    def generator_terms(self, adapter, work: ForwardWork, d: TDMDraw, embeds, state: TDMState) -> ObjectiveTerms:
        """L of the draw's rows (module docstring); the generator's detached outputs kept for the fake step."""
        s, dev, n = work.samples, adapter.device, len(d.rows)
        x0, x_next = self._generator_output(adapter, work, d, embeds, grad=True)
        state.outputs[(d.mb, d.boundary)] = (x0.detach(), x_next.detach())
        sn = float(s.sigmas[d.step + 1])
        with torch.no_grad():
            x_tau = renoise(x_next.detach(), sn, d.tau, d.noise.to(dev))
            tau = torch.full((n,), d.tau, device=dev)
            v_fake = module_velocity(adapter, self.fake_forward, x_tau, tau, embeds, 1.0)
            cond, guided, uncond = self._real(adapter, x_tau, tau, embeds)
            x0_fake, x0_cond = x0_from_velocity(x_tau, v_fake, tau), x0_from_velocity(x_tau, cond, tau)
            kl = x0_cond - x0_fake
            cfg = self.o.cfg_reward_scale * (x0_cond - x0_from_velocity(x_tau, uncond, tau))
            wf = mean_dims((x0.detach() - x0_from_velocity(x_tau, guided, tau)).abs())
            reward = wd = None
            if d.step < self.o.trunc_steps:
                x_d = renoise(x_next.detach(), sn, d.tau_reward, d.reward_noise.to(dev))
                tau_d = torch.full((n,), d.tau_reward, device=dev)
                v_s = module_velocity(adapter, self.surrogate_forward, x_d, tau_d, embeds,
                                     self.o.surrogate_guidance_scale)
                v_ref = module_velocity(adapter, self.teacher, x_d, tau_d, embeds, 1.0)
                x0_s = x0_from_velocity(x_d, v_s, tau_d)
                reward = x0_s - x0_from_velocity(x_d, v_ref, tau_d)
                wd = mean_dims((x0.detach() - x0_s).abs())
        return generator_loss(x0, kl, cfg, wf, self.o, reward, wd)

    def fake_terms(self, adapter, work: ForwardWork, d: TDMDraw, embeds, state: TDMState) -> ObjectiveTerms:
        """L_fake of the draw's rows on the generator's outputs of this iteration's generator step (or, with
        none, the generator's outputs now, without gradient)."""
        s, dev, n = work.samples, adapter.device, len(d.rows)
        kept = state.outputs.pop((d.mb, d.boundary), None)
        x0, x_next = kept if kept is not None else self._generator_output(adapter, work, d, embeds, grad=False)
        x_tau = renoise(x_next, float(s.sigmas[d.step + 1]), d.tau, d.noise.to(dev))
        tau = torch.full((n,), d.tau, device=dev)
        target = (x_tau - x0) / d.tau
        v_real = module_velocity(adapter, self.teacher, x_tau, tau, embeds, 1.0)
        v_fake = module_velocity(adapter, self.fake_forward, x_tau, tau, embeds, 1.0, grad=True)
        return ObjectiveTerms(loss=fake_loss(v_fake, target, v_real, self.o.fake_reg))

    def surrogate_terms(self, adapter, work: ForwardWork, d: TDMDraw, embeds, state: TDMState) -> ObjectiveTerms:
        """L_s of the draw's rows (module docstring) at boundary j′ on the rollout's state x_{j′+1}."""
        s, dev, n = work.samples, adapter.device, len(d.rows)
        sn = float(s.sigmas[d.step + 1])
        x = s.latents[d.rows.to(s.latents.device), d.step + 1].to(dev).float()
        noise = d.noise.to(dev)
        x_tau, target = renoise(x, sn, d.tau, noise), surrogate_target(x, sn, d.tau, noise)
        tau = torch.full((n,), d.tau, device=dev)
        v_real = module_velocity(adapter, self.teacher, x_tau, tau, embeds, 1.0)
        v_old = module_velocity(adapter, self.slow_forward, x_tau, tau, embeds, 1.0)
        v = module_velocity(adapter, self.surrogate_forward, x_tau, tau, embeds, 1.0, grad=True)
        t = s.sigmas.numel() - 1
        weight = (d.step + 1) / t if self.o.time_weighting else 1.0
        x_extra = work.extra
        return surrogate_loss(v, v_old, v_real, target, work.advantages[d.rows], x_extra["group_index"][d.rows],
                              x_extra["num_groups"], self.o, group_size=self.cfg.train.group_size,
                              time_weight=weight, reduce_group_sums=dist.all_reduce_sum)

    def loss(self, adapter, work: ForwardWork, d: TDMDraw, state: TDMState, at: MicroBatchAt) -> torch.Tensor:
        """The draw's loss (its kind's) summed over its trained rows; its statistics recorded."""
        s = work.samples
        embeds = s.embeds.index(d.rows.to(s.embeds.device))
        terms = getattr(self, f"{d.kind}_terms")(adapter, work, d, embeds, state)
        mask = work.trained[d.rows].to(terms.loss.device)
        if not at.filler:
            getattr(state, d.kind).add(terms, mask)
        return (terms.loss * mask.to(terms.loss.dtype)).sum()

    def update_metrics(self, adapter, work: ForwardWork, state: TDMState) -> dict[str, float]:
        """The generator's ``objective/<stat>`` means, the fake score's ``objective/fake_<stat>`` and the
        surrogate's ``objective/surrogate_<stat>``, their mean gradient norms and step counts, and the slow
        surrogate's last decay ``objective/slow_decay``."""
        out = state.generator.metrics()
        for role, optim in (("fake", self.fake_optim), ("surrogate", self.surrogate_optim)):
            out.update({k.replace("objective/", f"objective/{role}_", 1): v
                        for k, v in getattr(state, role).metrics().items()})
            norms, optim.norms = optim.norms, []
            if norms:
                out[f"objective/{role}_grad_norm"] = sum(norms) / len(norms)
            out[f"objective/{role}_steps"] = float(optim.steps)
        out["objective/slow_decay"] = self.slow_decay
        return out

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The fake score's, the surrogate's and the slow surrogate's own weights (``fake.``, ``surrogate.``,
        ``slow.``: their LoRA weights, or whole copies) and the two optimizers' states (``fake_optim.``,
        ``surrogate_optim.``), on the host."""
        if self.fake is None:
            return {}
        out = {}
        for name in ("fake", "surrogate", "slow"):
            out.update({f"{name}.{k}": v.detach().cpu().clone() for k, v in own_tensors(getattr(self, name)).items()})
        for name in ("fake_optim", "surrogate_optim"):
            out.update({f"{name}.{k}": v for k, v in getattr(self, name).state_dict().items()})
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load :meth:`state_dict`'s tensors (``ValueError`` when they are not a TDM-R1 state of this model)."""
        if self.fake is None:
            raise RuntimeError("objective tdm_r1: attach(adapter, rewards) was not called before the resume")
        for name in ("fake", "surrogate", "slow"):
            weights = {k[len(name) + 1:]: v for k, v in state.items() if k.startswith(f"{name}.")}
            own = own_tensors(getattr(self, name))
            if weights.keys() != own.keys() or any(weights[k].shape != own[k].shape for k in own):
                raise ValueError(f"the checkpoint's objective state is not a TDM-R1 {name} model of this model (its "
                                 "keys or shapes differ)")
            with torch.no_grad():
                for k, t in own.items():
                    t.copy_(weights[k])
        for name in ("fake_optim", "surrogate_optim"):
            getattr(self, name).load_state_dict({k[len(name) + 1:]: v for k, v in state.items()
                                                 if k.startswith(f"{name}.")})
        steps = self.surrogate_optim.steps
        self.slow_decay = min(self.o.slow_decay_max, self.o.slow_decay_min + 0.001 * (steps - 1)) if steps else 0.0
