"""The copies of a teacher that the distillation objectives keep beside the trained model (DMD2's fake score,
TDM-R1's fake score, surrogate and slow surrogate) and the velocity of any such module through the model's adapter.

The real score is the teacher itself (:func:`real_score`); a trained copy is either a whole float32 copy
(:func:`trainable_copy`) or a LoRA adapter on the teacher's own weights (:func:`lora_copy`); :func:`own_tensors`
names what a copy holds itself (its checkpoint state)."""

from __future__ import annotations

import copy

import torch

from flowgrpo.algo.objectives.opd import load_teacher

__all__ = ["real_score", "trainable_copy", "lora_copy", "own_tensors", "trained_parameters", "copy_own_tensors",
           "module_velocity"]


def real_score(teacher: str | None, adapter, model_config) -> torch.nn.Module:
    """The frozen real score: ``objective.teacher`` (:func:`~flowgrpo.algo.objectives.opd.load_teacher`), or with
    none a fresh load of the run's base model's transformer (``model_config``, the run's ``model`` section), on the
    adapter's device in its dtype, without gradient, in eval mode."""
    if teacher:
        return load_teacher(teacher, adapter, model_config)
    from flowgrpo.models import load_model_from_config

    base = load_model_from_config(model_config, progress=False).transformer
    return base.to(adapter.device).requires_grad_(False).eval()


def trainable_copy(teacher: torch.nn.Module, device) -> tuple[torch.nn.Module, object]:
    """(module, forward): a trainable copy of ``teacher`` with float32 weights (DMD2's ``.float()`` fake score,
    ``sd_guidance.py`` lines 53–56), and what its forwards call: the module itself when the teacher is float32,
    else the module computing in the teacher's dtype under autocast (:class:`~flowgrpo.parallel.ComputeIn`, the
    release's ``network_context_manager``, line 143)."""
    module = copy.deepcopy(teacher).requires_grad_(True)
    compute = next(teacher.parameters()).dtype
    if compute == torch.float32:
        return module, module
    from flowgrpo.parallel import ComputeIn

    return module, ComputeIn(module.to(torch.float32), compute, torch.device(device).type)


def module_velocity(adapter, module, x: torch.Tensor, sigma: torch.Tensor, embeds, guidance: float, *,
                    grad: bool = False) -> torch.Tensor:
    """The adapter's velocity (n, …) at (x, σ) with ``module`` (a transformer, or a callable forwarding one: the
    real or fake score) as its forward module, with gradient only when ``grad``."""
    from flowgrpo.models.base import _forward_with

    with torch.set_grad_enabled(grad), _forward_with(adapter, module):
        return adapter.velocity(x, sigma, embeds, guidance)


def lora_copy(teacher: torch.nn.Module, rank: int, alpha: float, targets) -> torch.nn.Module:
    """A module sharing ``teacher``'s weights and buffers (the same tensors: no memory) with its own trainable LoRA
    adapter (rank r, alpha, ``targets``; the student's initialisation, ``init_lora_weights="gaussian"``: B = 0, so
    it starts as the teacher), as the script's ``fake`` and ``dgpo`` adapters on the base model."""
    from peft import LoraConfig

    memo = {id(t): t for t in [*teacher.parameters(), *teacher.buffers()]}
    module = copy.deepcopy(teacher, memo)
    module.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian", target_modules=list(targets)))
    return module


def own_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a copy holds itself: its LoRA weights (``lora_`` in the name), or every tensor of a whole
    copy."""
    named = dict(module.state_dict(keep_vars=True))
    lora = {k: v for k, v in named.items() if "lora_" in k}
    return lora or named


def trained_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


@torch.no_grad()
def copy_own_tensors(dst: torch.nn.Module, src: torch.nn.Module) -> None:
    """``dst``'s own tensors set to ``src``'s (the slow surrogate starts as the surrogate)."""
    theirs = own_tensors(src)
    for k, t in own_tensors(dst).items():
        t.copy_(theirs[k])
