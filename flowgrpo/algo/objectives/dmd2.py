"""DMD2: distribution-matching distillation of a many-step teacher into a few-step student, with an online fake
score (``objective: {name: dmd2, teacher: FOLDER}``; Yin et al., "Improved Distribution Matching Distillation for
Fast Image Synthesis", arXiv 2405.14867; release tianweiy/DMD2 at commit 8d8fa55, read in ``main/sd_guidance.py``,
``main/sd_unified_model.py`` and ``main/train_sd.py``; the line numbers below are that commit's).

Three models: the **student** (the trained model, the generator, sampling in ``sampling.num_steps`` steps), the
frozen **real score** (the teacher, :func:`~flowgrpo.algo.objectives.opd.load_teacher`; by default the run's own
base model) and the **fake score**, a trainable copy of the teacher (the release's ``fake_unet``, a whole copy
initialised from the teacher, ``sd_guidance.py`` lines 53–58) that learns the student's distribution by flow
matching on its samples. In the flow convention ``x_σ = (1 − σ)·x₀ + σ·ε`` with velocity ``v = ε − x₀`` every x₀
prediction is ``x̂₀ = x_σ − σ·v``.

**Rollout (backward simulation).** The student samples its own Euler path on the model's grid σ₀ = 1 > … > σ_T = 0,
keeping every latent (:func:`~flowgrpo.algo.objectives.paths.path_rollout`; the release's ``sample_backward``,
``sd_unified_model.py`` lines 127–162, runs the generator's own steps without gradient to reach the state it
trains from).

**Generator output.** Per micro-batch a step j ∈ {0, …, T − 1} is drawn (one for the micro-batch, as the release's
``selected_step`` is one for the batch, line 138), and the student's output is its x₀ prediction from its own
state there, with gradient: ``G = x_j − σ_j·v_θ(x_j, σ_j)`` at the rollout's guidance.

**Distribution-matching loss** (``compute_distribution_matching_loss``, ``sd_guidance.py`` lines 168–255), without
gradient except through G: t ~ U{min_step … max_step} (``min_step = int(min_step_percent·T_train)``, lines
84–85, 179–185), σ = (t + 1)/T_train (the DDPM index t ∈ [0, T_train) as a flow σ in (0, 1]), fresh ε,
``x_σ = (1 − σ)·G + σ·ε``; the real score at ``real_guidance_scale`` (CFG) and the fake score without guidance
(``fake_guidance_scale`` 1, asserted at line 90) give x̂₀^real and x̂₀^fake, and

    grad = (x̂₀^fake − x̂₀^real) / mean_dims(|G − x̂₀^real|)        (lines 235–239: (p_real − p_fake)/|p_real|.mean,
                                                                  p = latents − pred_image; NaN → 0)
    L_DM = ½·mean_dims((G − sg(G − grad))²)                     (line 241, an MSE to a stop-gradient target)

so ∂L_DM/∂G = grad / D (D the latent size). The optimizer step minimises the mean of ``dm_loss_weight·L_DM`` over
its rows (line 369).

**Fake-score loss** (``compute_loss_fake``, lines 257–310) on the student's output G, detached: t ~ U{0 … T_train −
1}, σ = (t + 1)/T_train, fresh ε, the fake score's velocity at ``x_σ = (1 − σ)·G + σ·ε`` without guidance against
the flow-matching target: ``L_fake = mean_dims((v_fake − (ε − G))²)`` (the release's ε-prediction MSE, line 295,
in velocity form).

**Two time scales** (``train_one_step``, ``train_sd.py`` lines 322–408): each *iteration* (one share of the epoch's
micro-batches: ``train.optimizer_steps_per_epoch`` iterations an epoch) first updates the generator when the
run's iteration count is a multiple of ``dfake_gen_update_ratio`` (line 330, 367–376), then the fake score, on the
generator output computed before the generator's step (``guidance_data_dict``, lines 339–347 and 386–393), so the
fake score takes ``dfake_gen_update_ratio`` steps per generator step. The fake score has its own AdamW
(:class:`~flowgrpo.training.optim.SecondOptimizer`, lines 191–202: the same betas and weight decay, its own
learning rate ``fake_lr``, the release's ``guidance_lr``, equal to ``generator_lr`` in every release script) and
its gradient clipped to ``train.max_grad_norm`` as the generator's (line 404). The iteration count is the fake
optimizer's step count (checkpointed with its state and the fake score's weights: ``objective.safetensors``).

**GAN term** (optional, off by default as in the release: ``objective.gan``, the release's ``cls_on_clean_image``
and ``gen_cls_loss``, lines 145–165, 312–395): a classifier head on one block of the fake score, trained with it in
its step, and the generator's non-saturating loss added to its DM loss
(:mod:`~flowgrpo.algo.objectives.dmd2_gan`).

Not here: the release's regression loss (DMD, dropped in DMD2); its fresh re-noising
between the generator's steps (``sample_backward`` adds new noise at each step; here the path is the student's
Euler path, the sampler it is evaluated with). Fidelity table: docs/fidelity_forward.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
from pydantic import Field, model_validator

from flowgrpo.algo.objectives.base import OBJECTIVES, TEACHER, MicroBatchAt, ObjectiveConfig, UpdateStep
from flowgrpo.algo.objectives.dmd2_gan import (
    GanConfig,
    GanDraw,
    RealImages,
    block_features,
    classifier_loss,
    draw_gan_sigmas,
    frozen,
    generator_gan_loss,
    make_head,
)
from flowgrpo.algo.objectives.flow_matching import ObjectiveTerms, mean_dims, noised, x0_from_velocity
from flowgrpo.algo.objectives.forward import ForwardObjective, ForwardWork, _Stats, sde_ratio_problems
from flowgrpo.algo.objectives.opd import check_teacher
from flowgrpo.algo.objectives.paths import EULER_PATH_INSTEAD, PathDraw, PathSamples, path_rollout
from flowgrpo.algo.objectives.teacher_copies import module_velocity, real_score, trainable_copy
from flowgrpo.records import Advantages
from flowgrpo.rng import derive_seed, make_generator

__all__ = ["DMD2", "DMD2Config", "dm_gradient", "dm_loss", "fake_score_loss", "draw_sigmas", "iteration_schedule"]


def dm_gradient(generated: torch.Tensor, x0_real: torch.Tensor, x0_fake: torch.Tensor) -> torch.Tensor:
    """The distribution-matching gradient (n, …) float32 (module docstring): ``(x̂₀^fake − x̂₀^real) /
    mean_dims(|G − x̂₀^real|)`` per row, NaN and ±inf set to 0 (``torch.nan_to_num``, as the release), detached.

    Args:
        generated: G (n, …), the student's output. x0_real, x0_fake: (n, …) the two scores' x₀ predictions."""
    g, real, fake = generated.detach().float(), x0_real.detach().float(), x0_fake.detach().float()
    norm = (g - real).abs().mean(dim=tuple(range(1, g.ndim)), keepdim=True)
    return torch.nan_to_num((fake - real) / norm)


def dm_loss(generated: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``½·mean_dims((G − sg(G − grad))²)`` (n,) float32 with gradient through ``generated`` only: its gradient
    with respect to G is ``grad / D`` per row (D the latent size)."""
    g = generated.float()
    return 0.5 * mean_dims((g - (g - grad.float()).detach()).square())


def fake_score_loss(v_fake: torch.Tensor, generated: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``mean_dims((v_fake − (ε − G))²)`` (n,) float32: the fake score's flow-matching loss on the student's
    output G (detached) noised with ε."""
    target = noise.float() - generated.detach().float()
    return mean_dims((v_fake.float() - target).square())


def draw_sigmas(gen: torch.Generator, n: int, low: int, high: int, num_train_timesteps: int) -> torch.Tensor:
    """(n,) float32 σ = (t + 1)/T_train for t uniform on the integers low … high − 1 (the release's
    ``torch.randint(low, high)``), from ``gen``."""
    t = torch.randint(low, high, (n,), generator=gen)
    return (t.double() + 1).div(num_train_timesteps).float()


def iteration_schedule(done: int, iterations: int, ratio: int) -> list[tuple[str, int]]:
    """The optimizer steps of ``iterations`` DMD2 iterations after ``done`` earlier ones, in order: ("generator",
    i) then ("fake", i) for iteration i when ``(done + i) % ratio == 0``, else ("fake", i) alone (``train_sd.py``
    lines 330, 367–408: the generator first, then the fake score)."""
    out: list[tuple[str, int]] = []
    for i in range(iterations):
        if (done + i) % ratio == 0:
            out.append(("generator", i))
        out.append(("fake", i))
    return out


class DMD2Config(ObjectiveConfig):
    """``objective: {name: dmd2, teacher: FOLDER, ...}``: DMD2 (module docstring); the student's step count is
    ``sampling.num_steps``."""

    name: Literal["dmd2"] = "dmd2"
    teacher: str | None = TEACHER
    real_guidance_scale: float | None = Field(None, ge=0, description="DMD2: the real score's guidance (CFG; the "
                                              "release's real_guidance_scale: SDXL 8, SD1.5 1.75); default "
                                              "sampling.guidance_scale")
    dfake_gen_update_ratio: int = Field(5, ge=1, description="DMD2: fake-score updates per generator update (the "
                                        "release's SDXL and ImageNet scripts: 5; SD1.5: 10)")
    fake_lr: float | None = Field(None, gt=0, description="DMD2: the fake score's learning rate (the release's "
                                  "guidance_lr, equal to generator_lr in its scripts); default train.lr")
    dm_loss_weight: float = Field(1.0, ge=0, description="DMD2: weight of the distribution-matching loss (1)")
    min_step_percent: float = Field(0.02, ge=0, lt=1, description="DMD2: the smallest DM timestep, a fraction of "
                                    "num_train_timesteps (0.02)")
    max_step_percent: float = Field(0.98, gt=0, le=1, description="DMD2: the largest DM timestep, a fraction of "
                                    "num_train_timesteps (0.98)")
    num_train_timesteps: int = Field(1000, ge=2, description="DMD2: the timestep count T_train whose integers t "
                                     "are drawn (sigma = (t + 1)/T_train; 1000)")
    gan: GanConfig = Field(default_factory=GanConfig, description="DMD2: the optional GAN term (a classifier head "
                           "on the fake score, the generator's non-saturating loss); off while gan.gen_weight is 0")

    trains_on: ClassVar[str] = "the student's own rollout path, scored by the teacher and a fake score"
    instead: ClassVar[dict[tuple[str, str], str]] = EULER_PATH_INSTEAD

    @model_validator(mode="after")
    def _steps_ordered(self):
        low, high = self.dm_steps()
        if low >= high:
            raise ValueError(f"objective.min_step_percent={self.min_step_percent} and max_step_percent="
                             f"{self.max_step_percent} of num_train_timesteps={self.num_train_timesteps} leave no "
                             "timestep: min_step must be below max_step")
        if self.gan.on and not self.gan.real_images:
            raise ValueError(f"objective.gan.gen_weight={self.gan.gen_weight} turns the GAN term on, which needs "
                             "objective.gan.real_images: an image set of {prompt, target} records (e.g. digits_real)")
        moved = [f"{k}={v!r}" for k, v in self.gan.model_dump().items()
                 if k != "gen_weight" and v != GanConfig.model_fields[k].default]
        if not self.gan.on and moved:
            raise ValueError(f"objective.gan.{moved[0]} is read only with the GAN term on, and objective.gan."
                             "gen_weight is 0 (off): set gen_weight > 0 (the release's 5e-3) or remove the setting")
        if self.gan.noise_steps > self.num_train_timesteps:
            raise ValueError(f"objective.gan.noise_steps={self.gan.noise_steps} is above num_train_timesteps="
                             f"{self.num_train_timesteps}: the classifier's timesteps are drawn below it")
        return self

    def dm_steps(self) -> tuple[int, int]:
        """(low, high) of the DM timestep draw t ∈ [low, high) (``sd_guidance.py`` lines 84–85, 179–181)."""
        t = self.num_train_timesteps
        return int(self.min_step_percent * t), min(int(self.max_step_percent * t) + 1, t)

    def problems(self, config) -> list[str]:
        """The SDE-ratio settings (:func:`~flowgrpo.algo.objectives.forward.sde_ratio_problems`), one line each."""
        return super().problems(config) + sde_ratio_problems(self, config)


@dataclass(frozen=True)
class DMDraw(PathDraw):
    """One micro-batch of a DMD2 step: ``kind`` ``generator`` or ``fake``, the student's step ``step`` (j), the
    loss's σ (n,) and ε (n, …) (host); ``gan`` the GAN term's draws (None while it is off)."""

    kind: str = "generator"
    gan: GanDraw | None = None


@dataclass
class DMD2State:
    """What an update's losses share: the generator's and the fake score's statistics, and the student's outputs
    of the generator steps (detached), which the same iteration's fake step trains on."""

    generator: _Stats = field(default_factory=_Stats)
    fake: _Stats = field(default_factory=_Stats)
    outputs: dict = field(default_factory=dict)


@OBJECTIVES.register("dmd2")
class DMD2(ForwardObjective):
    """DMD2 (module docstring) on the forward family's plan: per iteration (a share of the micro-batches) a
    generator step (every ``dfake_gen_update_ratio``-th iteration) and a fake-score step, each one draw per
    micro-batch; the fake score is stepped by its own :class:`~flowgrpo.training.optim.SecondOptimizer`."""

    Config = DMD2Config
    #: verified with rollout workers (tests/runtime/test_ray_identity.py)
    rollout_workers_refusal = None
    uses_old_copy = False
    frozen_teacher = True  # the real score: a whole transformer on the device (the memory plan counts it)
    trains_teacher_copy = True  # the fake score: a whole trained copy with its AdamW (the memory plan counts it)
    trains_on_advantages = False  # the teacher and the fake score are the signal, no reward enters

    def __init__(self, config) -> None:
        super().__init__(config)
        self.teacher: torch.nn.Module | None = None
        self.fake: torch.nn.Module | None = None
        self.fake_forward = None  # the fake score's forward (the module, or it computing in model.dtype)
        self.fake_optim = None
        self.gan_head: torch.nn.Module | None = None  # the GAN term's classifier head (objective.gan on)
        self.gan_block: torch.nn.Module | None = None  # the fake score's block the head reads
        self.gan_block_index: int | None = None  # its place among the adapter's feature_blocks
        self.real: RealImages | None = None
        self.real_first = None  # the first real image's ((width, height), where), read by validate()

    @property
    def needs_reference(self) -> bool:
        """No KL to the base model."""
        return False

    def validate(self) -> None:
        """One pass an update (the iteration count is the fake optimizer's); the teacher folder's layout and, where
        the student's class is known from its folder, the teacher's family; with the GAN term on, every real image
        opened (:func:`~flowgrpo.data.image_sets.check_dataset_images`); before any model loads."""
        if self.cfg.train.inner_epochs != 1:
            raise ValueError(f"objective.name=dmd2 runs one pass an update (its iterations alternate the generator "
                             f"and the fake score), got train.inner_epochs={self.cfg.train.inner_epochs}: set it to 1")
        if self.o.teacher:
            check_teacher(self.o.teacher, self.cfg.model)
        if self.o.gan.on:
            from flowgrpo.data.image_sets import TARGET_KEY, check_dataset_images
            from flowgrpo.data.prompts import load_prompts

            try:
                load_prompts(self.o.gan.real_images)  # a missing or malformed file, in one line
                self.real_first = check_dataset_images(self.o.gan.real_images, [TARGET_KEY])
            except ValueError as err:
                raise ValueError(f"objective.gan.real_images: {err}") from None

    def attach(self, adapter, rewards) -> None:
        """Load the real score (:func:`real_score`) and make the fake score, a trainable copy of it
        (:func:`trainable_copy`), with its optimizer; with the GAN term on, the classifier head
        (:meth:`attach_gan`), trained by the same optimizer."""
        self.teacher = real_score(self.o.teacher, adapter, self.cfg.model)
        self.fake, self.fake_forward = trainable_copy(self.teacher, adapter.device)
        params = list(self.fake.parameters())
        if self.o.gan.on:
            self.attach_gan(adapter)
            params += list(self.gan_head.parameters())
            self.real = RealImages(self.o.gan.real_images)
            if self.real_first and self.real_first[0] != (adapter.width, adapter.height):
                (w, h), where = self.real_first
                raise ValueError(f"objective.gan.real_images: {where} is {w}x{h} (width x height), the model makes "
                                 f"{adapter.width}x{adapter.height} (model.width x model.height); resize the set "
                                 "(python -m flowgrpo.data.image_sets ... --size H W)")
        lr = self.o.fake_lr if self.o.fake_lr is not None else self.cfg.train.lr
        self.fake_optim = self.optim.second_optimizer(params, lr=lr)  # prepare() came first

    def attach_gan(self, adapter) -> None:
        """The fake score's feature block (``gan.feature_block``, default the middle of the adapter's
        :meth:`~flowgrpo.models.base.AdapterBase.feature_blocks`) and the head on it (seeded by ``train.seed``).
        Raises ``ValueError`` (one line) for a block index past the model's blocks or a family without
        blocks."""
        blocks = adapter.feature_blocks(self.fake)
        k = len(blocks) // 2 if self.o.gan.feature_block is None else self.o.gan.feature_block
        if k >= len(blocks):
            raise ValueError(f"objective.gan.feature_block={k} is past the model's blocks: its transformer has "
                             f"{len(blocks)} (0 … {len(blocks) - 1}, in forward order)")
        self.gan_block, self.gan_block_index = blocks[k], k
        self.gan_head = make_head(adapter.feature_width(self.fake), derive_seed(self.cfg.train.seed, "dmd2_gan_head"),
                                  adapter.device)

    def trajectories_per_sample(self, sigmas: torch.Tensor, settings) -> int:
        return 1

    def sigmas_per_sample(self, sigmas: torch.Tensor) -> int:
        return 1

    def rollout(self, adapter, request) -> PathSamples:
        """The student's own Euler path (no gradient), every latent kept."""
        return path_rollout(adapter, request)

    def plan(self, samples: PathSamples, adv: Advantages, keep: torch.Tensor, epoch: int) -> ForwardWork:
        """The forward family's plan with every sample the group filter keeps trained (no advantage enters)."""
        return super().plan(samples, dataclasses.replace(adv, train_mask=torch.ones_like(adv.train_mask)), keep,
                            epoch)

    # ------------------------------------------------------------------ the update
    def update_steps(self, work: ForwardWork) -> list[UpdateStep]:
        """The epoch's iterations (one a share of micro-batches), each a generator step when due and a fake-score
        step (:func:`iteration_schedule`, counted from the fake optimizer's steps so far)."""
        if self.fake_optim is None:
            raise RuntimeError("objective dmd2: attach(adapter, rewards) was not called before the update")
        out = []
        for kind, i in iteration_schedule(self.fake_optim.steps, len(work.steps), self.o.dfake_gen_update_ratio):
            share, rows = work.steps[i], work.step_rows[i]
            optimizer = self.fake_optim if kind == "fake" else None
            out.append(UpdateStep((kind, share), rows, len(share), optimizer=optimizer))
        return out

    def update_state(self, work: ForwardWork) -> DMD2State:
        return DMD2State()

    def micro_batches(self, work: ForwardWork, step: UpdateStep, inner: int) -> list[DMDraw]:
        """One draw per micro-batch of the step's share (:meth:`draw`)."""
        kind, share = step.plan
        return [self.draw(work, rows, inner, kind) for rows in share]

    def draw(self, work: ForwardWork, rows: torch.Tensor, inner: int, kind: str) -> DMDraw:
        """Micro-batch ``rows``'s student step j (shared by its generator and fake steps) and the ``kind`` loss's σ
        and ε, seeded by (seed, epoch, pass, what, the global micro-batch): the same on any number of processes."""
        s, seed, n = work.samples, self.cfg.train.seed, len(rows)
        mb = work.micro_batch_index(rows)
        j = int(torch.randint(s.sigmas.numel() - 1, (1,), generator=make_generator(seed, work.epoch, inner,
                                                                                   "dmd2_step", mb)))
        gen = make_generator(seed, work.epoch, inner, f"dmd2_{kind}", mb)
        low, high = self.o.dm_steps() if kind == "generator" else (0, self.o.num_train_timesteps)
        sigma = draw_sigmas(gen, n, low, high, self.o.num_train_timesteps)
        noise = torch.randn((n, *s.x0.shape[1:]), generator=gen)
        gan = self.gan_draw(work, n, inner, kind, mb) if self.o.gan.on else None
        return DMDraw(rows, sigma, noise, step=j, kind=kind, gan=gan)

    def gan_draw(self, work: ForwardWork, n: int, inner: int, kind: str, mb: int) -> GanDraw:
        """The GAN term's σ and ε of the generated images and, for a fake step, the real records and their σ and ε,
        from their own generator of (seed, epoch, pass, what, the global micro-batch)."""
        g = make_generator(self.cfg.train.seed, work.epoch, inner, f"dmd2_gan_{kind}", mb)
        shape, steps, total = (n, *work.samples.x0.shape[1:]), self.o.gan.noise_steps, self.o.num_train_timesteps
        sigma = draw_gan_sigmas(g, n, steps, total)
        noise = torch.randn(shape, generator=g)
        if kind == "generator":
            return GanDraw(sigma, noise)
        index = torch.randint(len(self.real), (n,), generator=g)
        return GanDraw(sigma, noise, index, draw_gan_sigmas(g, n, steps, total), torch.randn(shape, generator=g))

    def logits(self, adapter, x: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor, embeds) -> torch.Tensor:
        """(n,) the classifier's logits of images ``x`` (n, …) noised with ε at σ (host draws): the head on the fake
        score's feature block (:func:`~flowgrpo.algo.objectives.dmd2_gan.block_features`)."""
        dev = adapter.device
        sigma = sigma.to(dev)
        x = noised(x, noise.to(dev), sigma)
        return self.gan_head(block_features(adapter, self.fake_forward, self.gan_block, x, sigma, embeds, grad=True))

    def student_output(self, adapter, work: ForwardWork, draw: DMDraw, embeds, *, grad: bool) -> torch.Tensor:
        """G = x_j − σ_j·v_θ(x_j, σ_j) (n, …) float32 at the rollout's guidance, from the student's state x_j."""
        s, j, dev = work.samples, draw.step, adapter.device
        x = s.latents[draw.rows.to(s.latents.device), j].to(dev).float()
        sig = torch.full((len(draw.rows),), float(s.sigmas[j]), device=dev)
        with torch.set_grad_enabled(grad):
            v = self.velocity(adapter, x, sig, embeds, guidance=s.guidance_scale)
            return x0_from_velocity(x, v, sig)

    def generator_terms(self, adapter, work: ForwardWork, draw: DMDraw, embeds, state: DMD2State) -> ObjectiveTerms:
        """``dm_loss_weight·L_DM`` of the draw's rows (module docstring), with stats ``dm_grad_abs`` (mean |grad|)
        and ``real_fake_gap`` (mean_dims (x̂₀^fake − x̂₀^real)²); the student's output kept for the fake step. With
        the GAN term on, plus ``gan.gen_weight·softplus(−D(G))`` (stat ``gan_gen_loss``, unweighted)."""
        dev = adapter.device
        generated = self.student_output(adapter, work, draw, embeds, grad=True)
        state.outputs[_key(draw)] = generated.detach()
        sigma, noise = draw.sigma.to(dev), draw.noise.to(dev)
        x = noised(generated.detach(), noise, sigma)
        g_real = work.samples.guidance_scale if self.o.real_guidance_scale is None else self.o.real_guidance_scale
        v_real = module_velocity(adapter, self.teacher, x, sigma, embeds, g_real, grad=False)
        v_fake = module_velocity(adapter, self.fake_forward, x, sigma, embeds, 1.0, grad=False)
        x0_real, x0_fake = x0_from_velocity(x, v_real, sigma), x0_from_velocity(x, v_fake, sigma)
        grad = dm_gradient(generated, x0_real, x0_fake)
        loss = self.o.dm_loss_weight * dm_loss(generated, grad)
        stats = {"dm_grad_abs": mean_dims(grad.abs()), "real_fake_gap": mean_dims((x0_fake - x0_real).square())}
        if self.o.gan.on:  # the fake score and the head pass the gradient to G and take none (train_sd.py 369-372)
            with frozen(self.fake, self.gan_head):
                gan = generator_gan_loss(self.logits(adapter, generated, draw.gan.noise, draw.gan.sigma, embeds))
            loss = loss + self.o.gan.gen_weight * gan
            stats["gan_gen_loss"] = gan.detach()
        return ObjectiveTerms(loss=loss, stats=stats)

    def fake_terms(self, adapter, work: ForwardWork, draw: DMDraw, embeds, state: DMD2State) -> ObjectiveTerms:
        """``L_fake`` of the draw's rows (module docstring) on the student's output of this iteration's generator
        step (before it), or, with none, the student's output now (no gradient); with the GAN term on, plus
        ``gan.guidance_weight`` times the classifier's loss (stats ``gan_cls_loss``, and the mean sigmoid of the
        real and generated images' logits ``gan_real_prob``, ``gan_fake_prob``)."""
        dev = adapter.device
        generated = state.outputs.pop(_key(draw), None)
        if generated is None:
            generated = self.student_output(adapter, work, draw, embeds, grad=False)
        sigma, noise = draw.sigma.to(dev), draw.noise.to(dev)
        x = noised(generated, noise, sigma)
        v_fake = module_velocity(adapter, self.fake_forward, x, sigma, embeds, 1.0, grad=True)
        loss = fake_score_loss(v_fake, generated, noise)
        if not self.o.gan.on:
            return ObjectiveTerms(loss=loss)
        g = draw.gan  # the classifier's loss on real and (detached) generated images (train_sd.py lines 398-401)
        real, real_embeds = self.real.batch(adapter, g.real_index)
        real_logits = self.logits(adapter, real, g.real_noise, g.real_sigma, real_embeds)
        fake_logits = self.logits(adapter, generated.detach(), g.noise, g.sigma, embeds)
        cls = classifier_loss(real_logits, fake_logits)
        return ObjectiveTerms(loss=loss + self.o.gan.guidance_weight * cls, stats={
            "gan_cls_loss": cls.detach(), "gan_real_prob": torch.sigmoid(real_logits.detach()),
            "gan_fake_prob": torch.sigmoid(fake_logits.detach())})

    def loss(self, adapter, work: ForwardWork, draw: DMDraw, state: DMD2State, at: MicroBatchAt) -> torch.Tensor:
        """The draw's loss (generator or fake score) summed over its trained rows; its statistics recorded."""
        s = work.samples
        embeds = s.embeds.index(draw.rows.to(s.embeds.device))
        fn = self.generator_terms if draw.kind == "generator" else self.fake_terms
        terms = fn(adapter, work, draw, embeds, state)
        mask = work.trained[draw.rows].to(terms.loss.device)
        if not at.filler:
            (state.generator if draw.kind == "generator" else state.fake).add(terms, mask)
        return (terms.loss * mask.to(terms.loss.dtype)).sum()

    def update_metrics(self, adapter, work: ForwardWork, state: DMD2State) -> dict[str, float]:
        """The generator's ``objective/<stat>`` means over its rows (``objective/loss`` the DM loss; none in an
        epoch without a generator step), the fake score's as ``objective/fake_<stat>``, the fake score's mean
        gradient norm ``objective/fake_grad_norm`` and its step count ``objective/fake_steps``."""
        out = state.generator.metrics()
        out.update({k.replace("objective/", "objective/fake_", 1): v for k, v in state.fake.metrics().items()})
        norms, self.fake_optim.norms = self.fake_optim.norms, []
        if norms:
            out["objective/fake_grad_norm"] = sum(norms) / len(norms)
        out["objective/fake_steps"] = float(self.fake_optim.steps)
        return out

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The fake score's weights (``fake.<name>``), the GAN head's (``gan_head.<name>``, with the GAN term on) and
        their optimizer's state (``fake_optim.<key>``), whole, on the host."""
        if self.fake is None:
            return {}
        out = {f"fake.{k}": v.detach().cpu().clone() for k, v in self.fake.state_dict().items()}
        if self.gan_head is not None:
            out.update({f"gan_head.{k}": v.detach().cpu().clone() for k, v in self.gan_head.state_dict().items()})
            out["gan_block"] = torch.tensor(self.gan_block_index)  # the block the head reads (resume: the same)
        out.update({f"fake_optim.{k}": v for k, v in self.fake_optim.state_dict().items()})
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load :meth:`state_dict`'s tensors into the fake score, the GAN head and their optimizer (``ValueError``
        when they are not a DMD2 state of this model and GAN setting)."""
        if self.fake is None:
            raise RuntimeError("objective dmd2: attach(adapter, rewards) was not called before the resume")
        weights = {k[len("fake."):]: v for k, v in state.items() if k.startswith("fake.")}
        own = self.fake.state_dict()
        if weights.keys() != own.keys() or any(weights[k].shape != own[k].shape for k in own):
            raise ValueError("the checkpoint's objective state is not a DMD2 fake score of this model (its keys or "
                             "shapes differ)")
        self.fake.load_state_dict(weights)
        self.load_head(state)
        self.fake_optim.load_state_dict({k[len("fake_optim."):]: v for k, v in state.items()
                                         if k.startswith("fake_optim.")})

    def load_head(self, state: dict[str, torch.Tensor]) -> None:
        """The GAN head's weights from ``state`` (``ValueError`` when the checkpoint has none and the GAN term is on,
        or has one and it is off)."""
        weights = {k[len("gan_head."):]: v for k, v in state.items() if k.startswith("gan_head.")}
        if self.gan_head is None:
            if weights:
                raise ValueError("the checkpoint's DMD2 state has a GAN head, and objective.gan.gen_weight is 0: "
                                 "resume with the GAN term on (its gan settings) or from another checkpoint")
            return
        if weights.keys() != self.gan_head.state_dict().keys():
            raise ValueError("the checkpoint's DMD2 state has no GAN head of this model (it was saved with "
                             "objective.gan off or another feature width): resume with its gan settings")
        saved = int(state["gan_block"]) if "gan_block" in state else None
        if saved != self.gan_block_index:
            raise ValueError(f"the checkpoint's GAN head reads block {saved} of the fake score, and objective.gan."
                             f"feature_block gives block {self.gan_block_index}: resume with feature_block={saved} "
                             "(its weights, guidance_weight and noise_steps may change on a resume)")
        self.gan_head.load_state_dict(weights)


def _key(draw: DMDraw) -> tuple:
    """The micro-batch (its rows) a generator step's output is kept under for the fake step."""
    return tuple(draw.rows.tolist())
