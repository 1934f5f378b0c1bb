"""Context parallelism's boundary (``flowgrpo.parallel``, ``flowgrpo.preflight``, the ``parallel`` schema), checked
in one process; the two-process runs are in ``tests/training/test_context_parallel.py``.

* the refusals, each one line naming the value: a family whose transformer diffusers cannot split (SD3: no
  ``_cp_plan``), Ulysses over more ranks than attention heads, ring attention on the CPU, a degree without FSDP2 or
  not dividing the world size, ring with float32 compute, without a degree or over a masked text (Qwen-Image),
  token counts the degree does not divide;
* a masked text (Qwen-Image's prompts padded to the batch's longest) padded to a multiple of the degree with
  masked zero rows instead;
* the batch is split over world size / degree data ranks;
* the CPU shim around diffusers' ``enable_parallelism``: without it, diffusers divides by the CPU's accelerator
  count (0) while resolving the parallel config; with it, resolution gets past the device, and torch's functions
  are restored after.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flowgrpo.config import ParallelConfig
from flowgrpo.config.loading import build_config
from flowgrpo.distributed import context_parallel, dist
from flowgrpo.preflight import check_batch

CPU = torch.device("cpu")
SHARDED = {"sharding": "fsdp2"}


def _settings(**kw) -> ParallelConfig:
    return ParallelConfig(**{**SHARDED, "context_degree": 2, **kw})


@pytest.fixture(scope="module")
def flux(tiny_flux_dir):
    from flowgrpo.models import load_model

    return load_model(str(tiny_flux_dir), max_sequence_length=16, height=32, width=32)


def test_a_family_without_a_cp_plan_is_refused_by_name():
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    tr = SD3Transformer2DModel(sample_size=4, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8,
                               num_attention_heads=2, joint_attention_dim=8, caption_projection_dim=16,
                               pooled_projection_dim=8, out_channels=4, pos_embed_max_size=8)
    pipe = StableDiffusion3Pipeline(transformer=tr, **dict.fromkeys(
        ("scheduler", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "text_encoder_3",
         "tokenizer_3")))
    sd3 = SimpleNamespace(transformer=tr, pipe=pipe, frozen_reference=None)  # what check_context reads
    with pytest.raises(ValueError, match=r"SD3Transformer2DModel \(StableDiffusion3Pipeline\), whose transformer "
                                         r"declares no _cp_plan") as err:
        context_parallel.check_context(sd3, _settings(), CPU)
    assert "\n" not in str(err.value)
    context_parallel.check_context(sd3, ParallelConfig(**SHARDED), CPU)  # degree 1: nothing to split, nothing refused


def test_a_family_with_a_cp_plan_passes_and_its_limits_are_refused(flux):
    context_parallel.check_context(flux, _settings(), CPU)  # FLUX: a _cp_plan, 2 heads
    with pytest.raises(ValueError, match=r"context_degree=4 with ulysses .* has 2, not a multiple of 4"):
        context_parallel.check_context(flux, _settings(context_degree=4), CPU)
    with pytest.raises(ValueError, match=r"context_attention=ring on the CPU: .*log-sum-exp"):
        context_parallel.check_context(flux, _settings(context_attention="ring"), CPU)


def test_the_degree_needs_fsdp2_and_ring_needs_half_precision_and_a_degree():
    with pytest.raises(ValueError, match=r"parallel.context_degree=2 .* set parallel.sharding=fsdp2"):
        ParallelConfig(context_degree=2)
    with pytest.raises(ValueError, match=r"parallel.context_attention=ring is read only with "
                                         r"parallel.context_degree > 1"):
        ParallelConfig(**SHARDED, context_attention="ring")
    with pytest.raises(ValueError, match=r"context_attention=ring with model.dtype=float32"):
        build_config({"parallel": _settings(context_attention="ring").model_dump()})
    build_config({"model": {"dtype": "bfloat16"}, "parallel": _settings(context_attention="ring").model_dump()})


def test_the_batch_is_split_over_the_data_ranks():
    cfg = build_config({"train": {"prompts_per_epoch": 3, "group_size": 2, "rollout_batch_size": 3},
                        "parallel": _settings().model_dump()})  # B = 6
    check_batch(cfg, 4)  # 2 data ranks of 3 samples
    check_batch(cfg, 2)  # 1 data rank (the context group) of 6
    with pytest.raises(ValueError, match=r"context_degree=2 must divide the world size 3"):
        check_batch(cfg, 3)
    plain = build_config({"train": {"prompts_per_epoch": 3, "group_size": 2, "rollout_batch_size": 3}})
    with pytest.raises(ValueError, match=r"cannot be split evenly over 4 processes"):
        check_batch(plain, 4)  # without context groups, 4 processes would each need 1.5 samples


def test_token_counts_the_degree_does_not_divide_are_refused(flux):
    tr, check = flux.transformer, context_parallel._check_sequence(2, "FluxTransformer2DModel")
    text = torch.zeros(1, 16, tr.config.joint_attention_dim)
    check(tr, (), {"hidden_states": torch.zeros(1, 4, 64), "encoder_hidden_states": text})
    with pytest.raises(ValueError, match=r"hidden_states of FluxTransformer2DModel has 9 tokens, not a multiple "
                                         r"of 2"):
        check(tr, (), {"hidden_states": torch.zeros(1, 9, 64), "encoder_hidden_states": text})
    with pytest.raises(ValueError, match=r"encoder_hidden_states of FluxTransformer2DModel has 15 tokens"):
        check(tr, (), {"hidden_states": torch.zeros(1, 4, 64), "encoder_hidden_states": text[:, :15]})
    # Wan: a (B, C, F, H, W) latent counts its (1, 2, 2) patches; its text is not split, so any length passes
    from diffusers import WanTransformer3DModel

    wan = SimpleNamespace(_cp_plan=WanTransformer3DModel._cp_plan, config=SimpleNamespace(patch_size=(1, 2, 2)))
    check = context_parallel._check_sequence(2, "WanTransformer3DModel")
    check(wan, (), {"hidden_states": torch.zeros(1, 16, 3, 4, 4), "encoder_hidden_states": torch.zeros(1, 7, 8)})
    with pytest.raises(ValueError, match=r"has 3 tokens"):  # 3 frames x 1 x 1 patches
        check(wan, (torch.zeros(1, 16, 3, 2, 2),), {})


@pytest.mark.skipif(torch.accelerator.device_count() > 0, reason="the shim is for machines without an accelerator")
def test_the_cpu_shim_lets_diffusers_resolve_its_parallel_config(flux):
    from diffusers import ContextParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    get, count = torch._C._get_accelerator, torch.accelerator.device_count
    dist.ensure_process_group(CPU)  # one process: diffusers' own check of the degree against it comes last
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("ring", "ulysses"))
        tr = flux.transformer
        with pytest.raises(ZeroDivisionError):  # rank % torch.accelerator.device_count(), 0 here
            tr._resolve_parallel_config(ContextParallelConfig(ulysses_degree=2, mesh=mesh))
        with context_parallel.cpu_accelerator():
            assert torch._C._get_accelerator() == CPU and torch.accelerator.device_count() == 1
            with pytest.raises(ValueError, match=r"must not exceed the world size \(1\)"):  # past the device
                tr._resolve_parallel_config(ContextParallelConfig(ulysses_degree=2, mesh=mesh))
        assert (torch._C._get_accelerator, torch.accelerator.device_count) == (get, count)
    finally:
        tr._parallel_config = None
        dist.release_own_group()


def test_a_masked_text_is_padded_to_the_degree_instead():
    """Qwen-Image pads each batch's prompts to its longest (any length) and masks the padding: its text gets
    masked zero rows up to a multiple of the degree (the real tokens' attention unchanged), the image tokens are
    still checked."""
    from diffusers import QwenImageTransformer2DModel

    qwen = SimpleNamespace(_cp_plan=QwenImageTransformer2DModel._cp_plan, config=SimpleNamespace(patch_size=2))
    with pytest.raises(ValueError, match=r"context_attention=ring with .*: its text is masked"):
        context_parallel.check_context(SimpleNamespace(transformer=qwen, pipe=SimpleNamespace(components={}),
                                               frozen_reference=None),
                               _settings(context_attention="ring"), torch.device("cuda"))
    check, text = context_parallel._check_sequence(2, "QwenImageTransformer2DModel"), torch.randn(2, 27, 8)
    _, kw = check(qwen, (), {"hidden_states": torch.zeros(2, 4, 64), "encoder_hidden_states": text})
    assert kw["encoder_hidden_states"].shape == (2, 28, 8) and torch.equal(kw["encoder_hidden_states"][:, :27], text)
    assert not kw["encoder_hidden_states"][:, 27].any()
    assert kw["encoder_hidden_states_mask"].tolist() == [[1] * 27 + [0]] * 2
    mask = torch.ones(2, 27, dtype=torch.long)
    mask[1, 20:] = 0  # the second prompt is shorter
    _, kw = check(qwen, (), {"hidden_states": torch.zeros(2, 4, 64), "encoder_hidden_states": text,
                             "encoder_hidden_states_mask": mask})
    assert kw["encoder_hidden_states_mask"].tolist() == [[1] * 27 + [0], [1] * 20 + [0] * 8]
    with pytest.raises(ValueError, match=r"hidden_states of QwenImageTransformer2DModel has 5 tokens"):
        check(qwen, (), {"hidden_states": torch.zeros(2, 5, 64), "encoder_hidden_states": text})


def test_a_second_token_stream_the_plan_leaves_whole_is_refused():
    """LTX-2 (diffusers 0.42): its ``_cp_plan`` splits the video tokens and the text, not the audio stream, whose
    attention then crashed on shapes at the first forward (``bench/context_families.py`` on 2 processes); the
    check refuses it at the boundary instead, naming the stream."""
    from diffusers import LTX2VideoTransformer3DModel

    with torch.device("meta"):
        tr = LTX2VideoTransformer3DModel(num_layers=1, num_attention_heads=2, attention_head_dim=8,
                                         audio_num_attention_heads=2, audio_attention_head_dim=8)
    ltx2 = SimpleNamespace(transformer=tr, pipe=SimpleNamespace(components={"transformer": tr}),
                           frozen_reference=None)
    with pytest.raises(ValueError, match=r"LTX2VideoTransformer3DModel .* but not its audio_hidden_states") as err:
        context_parallel.check_context(ltx2, _settings(), CPU)
    assert "\n" not in str(err.value)
    context_parallel.check_context(ltx2, ParallelConfig(**SHARDED), CPU)  # degree 1: nothing split
