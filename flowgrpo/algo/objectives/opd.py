"""On-policy distillation: a student samples its own trajectory, a frozen teacher scores each of its states
(``objective: {name: opd, teacher: FOLDER}``; DiffusionOPD, Li et al., arXiv 2605.15055).

The student (the trained model) rolls out with ``sampling.num_steps`` steps (its step count: fewer than the
teacher was trained with, for a few-step student) on the model's grid σ₀ = 1 > … > σ_T = 0, keeping every latent
(:func:`~flowgrpo.algo.objectives.paths.path_rollout`): Euler steps, or Flow-GRPO's ``flow_sde`` with
``a = objective.noise_level``. At each of the student's states x_j (j < ⌊T·f⌋, f = ``timestep_fraction``) the
student's and the teacher's transition means are formed from their velocities with the same step
(:func:`~flowgrpo.sampling.sde.transition_moments`), μ^S = μ(x_j, v_θ(x_j, σ_j)) and μ^T = μ(x_j, v_T(x_j, σ_j)),
and the per-step loss is the KL between the two transitions (paper eq. 11) or, for the deterministic sampler, its
ODE limit (eq. 12):

    a > 0:  D_j = mean_dims((μ^S − μ^T)²) / (2·d_j²),   d_j = a·√(σ_j/(1 − σ_j))   (Flow-GRPO's std_dev_t, σ = 1
                                                                                   guarded by the grid's σ₁)
    a = 0:  D_j = ½·mean_dims((μ^S − μ^T)²)             (= ½·(σ_{j+1} − σ_j)²·mean_dims((v_θ − v_T)²))

averaged over an optimizer step's (sample, j) rows, the teacher's mean detached. Release (ali-vilab/DiffusionOPD
as read in an unofficial mirror at commit abecb69cfa29, not linked: docs/fidelity_forward.md;
``scripts/train_sd3_opd.py``): ``compute_student_step`` / ``compute_teacher_step_mean`` (the
transition means of both at the student's ``latents[:, j]``, the teacher at its own ``guidance_scale``), the loss
block of the training pass (``delta = prev_sample_mean - teacher_prev_mean``; ``per_step_kl = 0.5 * delta**2`` when
``noise_level <= 0`` else ``delta**2 / (2 * std_dev_t**2)``; ``.mean`` over the latent dims, ``.mean`` over the
batch; one ``accelerator.backward`` per j with the accumulation over ``gradient_accumulation_steps ×
num_train_timesteps``, i.e. the mean over (sample, j)), ``num_train_timesteps = int(sample.num_steps *
train.timestep_fraction)`` (the first steps of the grid). The teacher in the release is a LoRA adapter beside the
student's on one backbone; here it is a whole frozen transformer (:func:`load_teacher`), kept on the model's device
beside the student (a sharded run keeps it whole on every process). No reward enters the loss: the rewards are
scored and logged as monitors, as the release's ``proxy_reward``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar, Literal

import torch
from pydantic import Field

from flowgrpo.algo.objectives.base import OBJECTIVES, TEACHER, TIMESTEP_FRACTION, ObjectiveConfig, shared_field
from flowgrpo.algo.objectives.flow_matching import ObjectiveTerms, mean_dims
from flowgrpo.algo.objectives.forward import ForwardObjective, ForwardWork, sde_ratio_problems
from flowgrpo.algo.objectives.paths import PathDraw, PathSamples, path_rollout
from flowgrpo.records import Advantages
from flowgrpo.sampling.sde import kl_to_reference, transition_moments

__all__ = ["OPD", "OPDConfig", "opd_step_loss", "opd_train_steps", "teacher_source", "load_teacher"]

LORA_FILE = "pytorch_lora_weights.safetensors"


def opd_train_steps(num_steps: int, fraction: float) -> int:
    """⌊T·f⌋, the student's steps each trajectory trains (the first of the grid; the release's
    ``num_train_timesteps``). Raises ``ValueError`` when it is 0 or f is outside (0, 1]."""
    if not 0 < fraction <= 1:
        raise ValueError(f"objective.timestep_fraction must be in (0, 1], got {fraction}")
    k = int(num_steps * fraction)
    if k < 1:
        raise ValueError(f"objective.timestep_fraction={fraction} of sampling.num_steps={num_steps} trains no step")
    return k


def opd_step_loss(mean_student: torch.Tensor, mean_teacher: torch.Tensor, std: torch.Tensor | None, sigma,
                  sigma_next, *, noise_level: float) -> torch.Tensor:
    """D_j of n rows (module docstring), (n,) float32: ½·mean_dims((μ^S − μ^T)²) for ``noise_level`` 0, else
    mean_dims((μ^S − μ^T)²)/(2·d²) with d Flow-GRPO's ``std_dev_t`` derived from the transition ``std`` (n,)
    (:func:`~flowgrpo.sampling.sde.kl_to_reference`, form ``flow_grpo``). The teacher's mean is detached."""
    mean_teacher = mean_teacher.detach().float()
    if noise_level == 0:
        return 0.5 * mean_dims((mean_student.float() - mean_teacher).square())
    return kl_to_reference(mean_student.float(), mean_teacher, std, sigma, sigma_next, kind="flow_sde",
                           form="flow_grpo")


def teacher_source(folder: str) -> tuple[str, Path]:
    """What ``objective.teacher`` names: ``("transformer", path)`` for a ``from_pretrained`` transformer folder (a
    full fine-tuning run's ``output_dir/transformer``, or the ``transformer/`` of a pipeline folder or a run folder),
    ``("lora", path)`` for a LoRA folder (a LoRA run's ``output_dir/lora``, or a run folder holding one). An embedded
    model's name (``digits``, ``tiny``: :data:`~flowgrpo.models.EMBEDDED_MODELS`) names its pipeline folder, built
    and cached on first use.

    Raises:
        ValueError: no such folder, or one holding neither (one line naming what was looked for).
    """
    from flowgrpo.models import EMBEDDED_MODELS, resolve_pretrained

    path = Path(resolve_pretrained(folder, progress=False) if folder in EMBEDDED_MODELS else folder).expanduser()
    if not path.is_dir():
        raise ValueError(f"objective.teacher={folder!r} is not a folder: give a run's output_dir, its transformer "
                         "or lora folder, a diffusers pipeline folder or an embedded model's name")
    places = (("transformer", path, "config.json"), ("lora", path, LORA_FILE),
              ("transformer", path / "transformer", "config.json"), ("lora", path / "lora", LORA_FILE))
    for kind, cand, marker in places:
        if (cand / marker).is_file():
            return kind, cand
    raise ValueError(f"objective.teacher={folder!r} holds no transformer (config.json, here or in transformer/) and "
                     f"no LoRA ({LORA_FILE}, here or in lora/)")


def _json_field(path: Path, *keys):
    """``path``'s JSON value at ``keys`` (e.g. ``config.json``'s ``_class_name``), or None when unreadable."""
    try:
        value = json.loads(path.read_text())
        for key in keys:
            value = value[key]
        return value
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def student_transformer_class(pretrained: str) -> str | None:
    """The transformer class of the student ``model.pretrained`` when it is known without building, loading or
    downloading anything: the ``transformer`` entry of a local folder's ``model_index.json`` (e.g.
    ``["diffusers", "SD3Transformer2DModel"]``) or of the one in the local hub cache; None otherwise (an embedded
    model not built yet, a hub id not cached: the check is then made when the teacher loads)."""
    from flowgrpo.models import EMBEDDED_MODELS

    if pretrained in EMBEDDED_MODELS:
        return None
    local = Path(pretrained).expanduser()
    if not local.is_dir():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(pretrained, "model_index.json")
        except Exception:  # noqa: BLE001 - not a hub id: the model's own loading names it
            return None
        if not isinstance(cached, str):
            return None
        local = Path(cached).parent
    entry = _json_field(local / "model_index.json", "transformer")
    return entry[1] if isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], str) else None


def check_teacher_family(folder: str, path: Path, student: str | None) -> None:
    """Refuse a transformer teacher (``path``, its ``config.json``) whose class is not the student's (``student``,
    a transformer class name; None: unknown, nothing checked) before diffusers reads its weights, whose own error
    would advise ``ignore_mismatched_sizes=True``. Raises ValueError naming both families."""
    teacher = _json_field(path / "config.json", "_class_name")
    if student and isinstance(teacher, str) and teacher != student:
        raise ValueError(f"objective.teacher={folder!r}: teacher family {teacher} vs student family {student} "
                         f"(model.pretrained): the teacher must be of the student's model family")


def check_teacher(folder: str, model_config) -> None:
    """``objective.teacher`` checked before any model loads (OPD, DMD2, TDM-R1): the folder's layout
    (:func:`teacher_source`); a transformer's family (:func:`check_teacher_family`); a LoRA inside a run folder
    trained on another base model than the student's (its run's ``config.yaml``, ``model.pretrained``), or whose file
    cannot be read (its header). Raises ValueError, one line."""
    kind, path = teacher_source(folder)
    if kind == "transformer":
        check_teacher_family(folder, path, student_transformer_class(model_config.pretrained))
        return
    from flowgrpo.models.lora import lora_shapes

    base = _run_base(path.parent)
    if base is not None and base != model_config.pretrained:
        raise ValueError(f"objective.teacher={folder!r} is a LoRA of model.pretrained={base!r} (its run's "
                         f"config.yaml), the student is {model_config.pretrained!r}: a LoRA teacher is loaded into "
                         "the student's base model, so it must be a LoRA of that model")
    try:
        lora_shapes(path / LORA_FILE)
    except ValueError as err:
        raise ValueError(f"objective.teacher={folder!r}: {err}") from None


def _run_base(run: Path) -> str | None:
    """``model.pretrained`` of the run folder ``run`` (its ``config.yaml``), or None when it is not readable."""
    import yaml

    try:
        value = yaml.safe_load((run / "config.yaml").read_text())["model"]["pretrained"]
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError):
        return None
    return value if isinstance(value, str) else None


def _unsharded_class(cls: type) -> type:
    """The transformer class under FSDP2's: ``fully_shard`` gives the module a class of its own
    (``FSDPFluxTransformer2DModel``, a subclass of ``FSDPModule`` and the model's class); else ``cls``."""
    from torch.distributed.fsdp import FSDPModule

    if issubclass(cls, FSDPModule):
        return next(c for c in cls.__mro__[1:] if not issubclass(c, FSDPModule))
    return cls


def load_teacher(folder: str, adapter, model_config) -> torch.nn.Module:
    """The frozen teacher transformer of ``objective.teacher`` (:func:`teacher_source`), on the adapter's device in
    its dtype, in eval mode, without gradient: a transformer folder loaded with the student transformer's class
    (``from_pretrained``), its class checked first to be the student's (:func:`check_teacher_family`); a LoRA
    folder loaded into a fresh copy of the run's base model (``model_config``, the run's ``model`` section) and
    fused into its weights."""
    kind, path = teacher_source(folder)
    if kind == "transformer":
        cls = _unsharded_class(type(adapter.transformer))
        check_teacher_family(folder, path, cls.__name__)
        teacher = cls.from_pretrained(str(path), torch_dtype=adapter.dtype)
    else:
        from flowgrpo.models import load_model_from_config
        from flowgrpo.models.lora import load_lora_into

        base = load_model_from_config(model_config, progress=False)
        try:
            load_lora_into(base.pipe, path)
        except (RuntimeError, ValueError, KeyError) as err:  # another model's LoRA: diffusers' size mismatch
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(f"objective.teacher={folder!r}: its LoRA does not fit model.pretrained="
                             f"{model_config.pretrained!r} ({first}): give a LoRA trained on the student's base "
                             "model") from None
        base.transformer.fuse_lora()
        base.transformer.unload_lora()
        teacher = base.transformer
    from flowgrpo.models.base import config_difference

    differ = config_difference(adapter.transformer.config, teacher.config)
    if differ:
        k, theirs, ours = differ
        raise ValueError(f"objective.teacher={folder!r} is another architecture than the student: its {k} is "
                         f"{theirs!r}, the student's {ours!r}; give a teacher of the student's model")
    return teacher.to(adapter.device).requires_grad_(False).eval()


class OPDConfig(ObjectiveConfig):
    """``objective: {name: opd, teacher: FOLDER, ...}``: on-policy distillation (module docstring); the student's
    step count is ``sampling.num_steps``."""

    name: Literal["opd"] = "opd"
    teacher: str | None = TEACHER
    teacher_guidance_scale: float | None = Field(None, ge=0, description="on-policy distillation: the teacher's "
                                                 "guidance (the release's per-teacher guidance_scale); default "
                                                 "sampling.guidance_scale")
    noise_level: float = Field(0.0, ge=0, description="on-policy distillation: the student's rollout noise a "
                               "(flow_sde); 0 (the release): Euler steps and the loss 1/2*mean (mu_S - mu_T)^2, "
                               "else the KL (mu_S - mu_T)^2 / (2*(a*sqrt(sigma/(1-sigma)))^2)")
    timestep_fraction: float = shared_field(TIMESTEP_FRACTION, 0.99)

    trains_on: ClassVar[str] = "every step of the student's own rollout path, against the teacher's velocity"
    instead: ClassVar[dict[tuple[str, str], str]] = {
        ("sampling", "sde_kind"): "its rollout is Euler steps, or flow_sde at objective.noise_level",
        ("sampling", "noise_level"): "its rollout's noise is objective.noise_level",
        ("sampling", "sigma_one_guard"): "its rollout is Euler steps, or flow_sde at objective.noise_level",
        ("sampling", "final_decode"): "it decodes its rollout's final sample",
    }

    def own_noise(self) -> list[tuple[str, float, str]]:
        """The student's rollout noise a of its own flow_sde steps (``objective.noise_level``)."""
        return [("flow_sde", self.noise_level, "objective.noise_level")]

    def problems(self, config) -> list[str]:
        """The SDE-ratio settings (:func:`~flowgrpo.algo.objectives.forward.sde_ratio_problems`), one line each."""
        return super().problems(config) + sde_ratio_problems(self, config)


@OBJECTIVES.register("opd")
class OPD(ForwardObjective):
    """On-policy distillation (module docstring) on the forward family's plan and update loop: per micro-batch one
    draw per trained step j, the student's forward with gradient and the teacher's without."""
    #: verified with rollout workers (tests/runtime/test_ray_identity.py)
    rollout_workers_refusal = None

    Config = OPDConfig
    uses_old_copy = False
    frozen_teacher = True  # load_teacher: a whole transformer on the device (the memory plan counts it)
    trains_on_advantages = False  # the teacher's velocity is the signal, no reward enters

    def __init__(self, config) -> None:
        super().__init__(config)
        self.teacher = None

    def loss_settings(self) -> tuple[float, float]:
        """(noise level, timestep fraction), checked."""
        opd_train_steps(max(self.cfg.sampling.num_steps, 1), self.o.timestep_fraction)
        return self.o.noise_level, self.o.timestep_fraction

    def validate(self) -> None:
        """The settings, the teacher folder's layout (:func:`teacher_source`) and, where the student's class is known
        from its folder (:func:`student_transformer_class`), the teacher's family, before any model loads."""
        self.loss_settings()
        if not self.o.teacher:
            raise ValueError("objective.name=opd needs objective.teacher: a run's output_dir, its transformer or lora "
                             "folder, or a diffusers pipeline folder")
        check_teacher(self.o.teacher, self.cfg.model)

    @property
    def needs_reference(self) -> bool:
        """No KL to the base model (the release's ``train.beta = 0``)."""
        return False

    def attach(self, adapter, rewards) -> None:
        """Load the frozen teacher (:func:`load_teacher`)."""
        self.teacher = load_teacher(self.o.teacher, adapter, self.cfg.model)

    def trajectories_per_sample(self, sigmas: torch.Tensor, settings) -> int:
        opd_train_steps(sigmas.numel() - 1, self.o.timestep_fraction)
        return 1

    def sigmas_per_sample(self, sigmas: torch.Tensor) -> int:
        return opd_train_steps(sigmas.numel() - 1, self.o.timestep_fraction)

    def rollout(self, adapter, request) -> PathSamples:
        """The student's own path (no gradient): Euler steps, or ``flow_sde`` at ``objective.noise_level``."""
        return path_rollout(adapter, request, noise_level=self.o.noise_level)

    def plan(self, samples: PathSamples, adv: Advantages, keep: torch.Tensor, epoch: int) -> ForwardWork:
        """The forward family's plan with every sample the group filter keeps trained (no advantage enters)."""
        import dataclasses

        return super().plan(samples, dataclasses.replace(adv, train_mask=torch.ones_like(adv.train_mask)), keep,
                            epoch)

    def draws(self, work: ForwardWork, rows: torch.Tensor, inner: int) -> list[PathDraw]:
        """One draw per trained step j = 0 … ⌊T·f⌋ − 1, at σ_j (nothing random)."""
        s = work.samples
        zeros = torch.zeros(()).expand((len(rows), *s.x0.shape[1:]))
        return [PathDraw(rows, s.sigmas[j].expand(len(rows)).clone(), zeros, step=j)
                for j in range(self.sigmas_per_sample(s.sigmas))]

    def teacher_velocity(self, adapter, x: torch.Tensor, sigma: torch.Tensor, embeds, guidance: float):
        """The teacher's velocity (no gradient) at (x, σ): the adapter's forward with the teacher module."""
        from flowgrpo.models.base import _forward_with

        if self.teacher is None:
            raise RuntimeError("objective opd: attach(adapter, rewards) was not called before the update")
        with torch.no_grad(), _forward_with(adapter, self.teacher):
            return adapter.velocity(x, sigma, embeds, guidance)

    def terms(self, adapter, work: ForwardWork, draw: PathDraw, x0: torch.Tensor, embeds) -> ObjectiveTerms:
        """D_j of the draw's rows (module docstring) with stats ``teacher_gap`` (mean_dims (v_θ − v_T)²)."""
        s, j, a = work.samples, draw.step, self.o.noise_level
        dev, n = x0.device, len(draw.rows)
        x = s.latents[draw.rows.to(s.latents.device), j].to(dev).float()
        sig = torch.full((n,), float(s.sigmas[j]), device=dev)
        g_student = s.guidance_scale
        g_teacher = g_student if self.o.teacher_guidance_scale is None else self.o.teacher_guidance_scale
        v_t = self.teacher_velocity(adapter, x, sig, embeds, g_teacher)
        v_s = self.velocity(adapter, x, sig, embeds, guidance=g_student)
        kind = "flow_sde" if a > 0 else "ode"
        sigma, sigma_next = float(s.sigmas[j]), float(s.sigmas[j + 1])
        guard = float(s.sigmas[1])  # the releases' sigma_max = sigmas[1] at sigma = 1
        m_s, std = transition_moments(x, v_s, sigma, sigma_next, kind=kind, noise_level=a, sigma_one_next=guard,
                                      check_sigmas=False)
        m_t, _ = transition_moments(x, v_t, sigma, sigma_next, kind=kind, noise_level=a, sigma_one_next=guard,
                                    check_sigmas=False)
        loss = opd_step_loss(m_s, m_t, std, torch.full((n,), sigma, device=dev),
                             torch.full((n,), sigma_next, device=dev), noise_level=a)
        return ObjectiveTerms(loss=loss, stats={"teacher_gap": mean_dims((v_s.detach().float() - v_t.float())
                                                                         .square())})
