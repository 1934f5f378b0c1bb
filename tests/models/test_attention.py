"""``model.attention_backend``: the SDPA kernels of the transformer, applied in rollout and training alike.

Whatever the choice, the trainer's log-probs with the rollout's layout equal the rollout's exactly (both calls run
the same kernels). On CPU, PyTorch has the math and flash kernels but neither the memory-efficient nor the cuDNN
one, so ``efficient`` must fail there: that proves the choice reaches the transformer, and the failure must be one
error naming the setting. ``auto`` on CUDA never offers cuDNN (its backward fails on some torch/cuDNN versions).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend

from flowgrpo.config import SamplingConfig
from flowgrpo.models.attention import ATTENTION_BACKENDS, AttentionBackendError, attention_context
from flowgrpo.sampling.packed_forward import chunk_forward
from flowgrpo.sampling.rollout import RolloutRequest, rollout

STEPS = 2


def _rollout(adapter):
    settings = SamplingConfig(num_steps=STEPS, guidance_scale=3.5, sde_kind="flow_sde", noise_level=0.7)
    request = RolloutRequest(["a red cube", "two cats"], [{}, {}], torch.tensor([0, 1]), torch.tensor([0, 0]),
                             settings=settings, batch_size=2, seed=0, epoch=0)
    traj = rollout(adapter, request, torch.ones(STEPS, dtype=torch.bool))
    return traj, settings


@pytest.fixture
def backend(tiny_flux, request):
    old = tiny_flux.attention_backend
    tiny_flux.attention_backend = request.param
    yield request.param
    tiny_flux.attention_backend = old


@pytest.mark.parametrize("backend", ["auto", "math", "flash"], indirect=True)
def test_training_log_probs_equal_the_rollouts_whatever_the_kernels(tiny_flux, backend):
    traj, settings = _rollout(tiny_flux)
    for t in range(STEPS):
        lp = chunk_forward(tiny_flux, traj, torch.arange(2), (t,), settings, with_ref=False).log_probs
        assert torch.equal(lp[:, 0].cpu(), traj.log_probs[:, t]), (backend, t)
    with tiny_flux.attention():  # the backward runs with the same kernels (as the trainer's update does)
        lp.sum().backward()
    tiny_flux.transformer.zero_grad(set_to_none=True)  # the shared fixture keeps no gradients


@pytest.mark.parametrize("backend", ["efficient"], indirect=True)
def test_an_unavailable_kernel_is_one_error_naming_the_setting(tiny_flux, backend):
    if torch.cuda.is_available():
        pytest.skip("CPU-only check: the memory-efficient kernel exists on CUDA")
    with pytest.raises(AttentionBackendError, match="model.attention_backend='efficient'"):
        _rollout(tiny_flux)


def test_math_and_auto_choices_differ_only_where_they_should():
    assert ATTENTION_BACKENDS.get("auto")("cpu") is None  # PyTorch's own choice off CUDA
    auto_cuda = ATTENTION_BACKENDS.get("auto")("cuda")
    assert SDPBackend.CUDNN_ATTENTION not in auto_cuda and SDPBackend.MATH in auto_cuda
    assert ATTENTION_BACKENDS.get("cudnn")("cuda") == [SDPBackend.CUDNN_ATTENTION]
    with pytest.raises(KeyError, match="did you mean 'flash'"), attention_context("flsh", torch.device("cpu")):
        pass


def test_other_errors_pass_through_unchanged():
    with pytest.raises(ValueError, match="plain"), attention_context("math", torch.device("cpu")):
        raise ValueError("plain")
    with pytest.raises(RuntimeError, match="^shape mismatch$"), attention_context("math", torch.device("cpu")):
        raise RuntimeError("shape mismatch")


def test_a_nested_scope_is_a_no_op_and_the_outer_one_closes_even_on_error(tiny_flux):
    """The update opens the scope around forward and backward; the forward's own scope inside it must not re-enter
    the kernel context, and an error inside must leave the adapter ready to open a fresh scope."""
    import contextlib

    adapter = tiny_flux
    with adapter.attention():
        assert isinstance(adapter.attention(), contextlib.nullcontext)
    assert not isinstance(adapter.attention(), contextlib.nullcontext)
    with pytest.raises(ValueError), adapter.attention():
        raise ValueError("inside")
    assert not isinstance(adapter.attention(), contextlib.nullcontext)
