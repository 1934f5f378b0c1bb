"""The SD3 adapter against diffusers' own ``StableDiffusion3Pipeline``, on a tiny random SD3.5-architecture
pipeline saved to disk and loaded through ``from_pretrained``; and short training runs through the real
trainer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

from flowgrpo.config import SamplingConfig, build_config, load_config
from flowgrpo.models import load_model
from flowgrpo.models.sd3 import SD3Adapter, build_tiny_sd3
from flowgrpo.sampling.rollout import denoise

PROMPTS = ["a red cat on a blue chair", "two green dogs"]
MSL = 12  # T5 tokens
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models gain nothing from intra-op threads; on a busy 2-core machine two OpenMP threads make each
    small matmul ~100x slower (measured: 15 ms vs 0.15 ms for a 32x32 linear)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    words = " ".join(PROMPTS).split()
    return build_tiny_sd3(tmp_path_factory.mktemp("tiny_sd3"), seed=0, words=words)


@pytest.fixture(scope="module")
def adapter(folder) -> SD3Adapter:
    a = load_model(str(folder), max_sequence_length=MSL)
    assert isinstance(a, SD3Adapter) and isinstance(a.pipe, StableDiffusion3Pipeline)
    return a


def _generators(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def _ode_images(adapter, prompts, seeds, num_steps, guidance):
    x0 = adapter.initial_latents(len(prompts), _generators(seeds))
    settings = SamplingConfig(num_steps=num_steps, guidance_scale=guidance, sde_kind="ode")
    with torch.no_grad():
        x, _, _ = denoise(adapter, x0, adapter.encode_prompts(prompts), adapter.sigmas(num_steps), settings,
                          torch.zeros(num_steps, dtype=torch.bool), None, record=False)
    return x, adapter.decode(x)


@pytest.mark.parametrize("guidance", [4.5, 1.0])
def test_ode_rollout_reproduces_pipeline_call(adapter, guidance):
    """Same seeds, prompts, guidance and steps: the pipeline's final latents and images are reproduced."""
    pipe, n, seeds = adapter.pipe, 6, [3, 11]
    captured = {}

    def keep_latents(_pipe, i, t, kwargs):
        captured["latents"] = kwargs["latents"]
        return {}

    with torch.no_grad():
        ref = pipe(prompt=PROMPTS, num_inference_steps=n, guidance_scale=guidance,
                   generator=_generators(seeds), max_sequence_length=MSL, output_type="pt",
                   callback_on_step_end=keep_latents).images
    pipe_sigmas = pipe.scheduler.sigmas.clone()  # the grid __call__ just set
    x, images = _ode_images(adapter, PROMPTS, seeds, n, guidance)
    assert torch.equal(adapter.sigmas(n), pipe_sigmas)
    assert images.shape == ref.shape == (2, 3, adapter.height, adapter.width)
    # Measured: bitwise equal in float32 on CPU (same batched [uncond; cond] forward, same float32 Euler
    # step); the tolerance only allows for kernels that differ between the two code paths on other hardware.
    torch.testing.assert_close(x, captured["latents"], rtol=0, atol=1e-5)
    torch.testing.assert_close(images, ref, rtol=0, atol=1e-5)
    assert float((images[0] - images[1]).abs().max()) > 1e-3  # different prompts and seeds: not trivial


def _shifted(sigma, shift):
    return shift * sigma / (1 + (shift - 1) * sigma)


@pytest.mark.parametrize("n", [1, 10, 40])
def test_sigma_grid_by_hand(adapter, n):
    """SD3's default grid: n points evenly spaced in the *unshifted* training σ from 1 to σ_min, then shifted
    (Esser et al. eq. 23, shift 3), then 0; σ_min = shift(1/1000), so the last step's σ is shifted twice."""
    shift = 3.0
    sigma_min = _shifted(1 / 1000, shift)
    expected = np.append(_shifted(np.linspace(1.0, sigma_min, n), shift), 0.0)
    np.testing.assert_allclose(adapter.sigmas(n).numpy(), expected, rtol=0, atol=1e-6)
    assert adapter.sigmas(n).dtype == torch.float32


def test_sigma_grid_dynamic_shift_matches_pipeline(adapter):
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                                            max_shift=1.16)
    pipe = StableDiffusion3Pipeline(**{**adapter.pipe.components, "scheduler": sched})
    pipe.set_progress_bar_config(disable=True)
    a = SD3Adapter(pipe, height=adapter.height, width=adapter.width, max_sequence_length=MSL)
    with torch.no_grad():
        pipe(prompt=PROMPTS[:1], num_inference_steps=4, max_sequence_length=MSL, output_type="latent")
    assert torch.equal(a.sigmas(4), pipe.scheduler.sigmas)


def _direct(transformer, x, t, embeds, pooled):
    return transformer(hidden_states=x, timestep=t, encoder_hidden_states=embeds, pooled_projections=pooled,
                       return_dict=False)[0]


def _branch_embeddings(adapter, prompts):
    """(cond, uncond) (embeds, pooled) pairs computed independently: the prompts, and "" on its own."""
    with torch.no_grad():
        encode = adapter.pipe.encode_prompt
        c_e, _, c_p, _ = encode(prompts, None, None, do_classifier_free_guidance=False,
                                max_sequence_length=MSL)
        u_e, _, u_p, _ = encode([""] * len(prompts), None, None, do_classifier_free_guidance=False,
                                max_sequence_length=MSL)
    return (c_e, c_p), (u_e, u_p)


def test_cfg_formula_against_two_transformer_calls(adapter):
    torch.manual_seed(0)
    x = torch.randn(2, 16, adapter.latent_h, adapter.latent_w)
    sigma = torch.tensor([0.9, 0.35])
    (c_e, c_p), (u_e, u_p) = _branch_embeddings(adapter, PROMPTS)
    with torch.no_grad():
        v_c = _direct(adapter.transformer, x, sigma * 1000, c_e, c_p)  # SD3 takes the raw 0..1000 timestep
        v_u = _direct(adapter.transformer, x, sigma * 1000, u_e, u_p)
        embeds = adapter.encode_prompts(PROMPTS)
        for s in (4.5, 7.0):
            torch.testing.assert_close(adapter.velocity(x, sigma, embeds, s), v_u + s * (v_c - v_u),
                                       rtol=0, atol=1e-5)
        # s <= 1: no guidance, as the pipeline's do_classifier_free_guidance = s > 1
        for s in (1.0, 0.5):
            torch.testing.assert_close(adapter.velocity(x, sigma, embeds, s), v_c, rtol=0, atol=1e-5)
    assert float((v_c - v_u).abs().max()) > 1e-3  # the two branches differ, so the check has teeth


def _param_grads(transformer, fn):
    params = [p for p in transformer.parameters() if p.requires_grad]
    return torch.cat([g.flatten() for g in torch.autograd.grad(fn(), params, allow_unused=False)])


@pytest.mark.parametrize("detach", [False, True])
def test_cfg_uncond_branch_gradient(adapter, detach):
    """Detached: ∇v = s·∇v_c (the uncond branch contributes nothing); not detached: (1 − s)·∇v_u + s·∇v_c."""
    a = SD3Adapter(adapter.pipe, height=adapter.height, width=adapter.width, max_sequence_length=MSL,
                   cfg_detach_uncond=detach)
    tr, s = a.transformer, 4.5
    tr.requires_grad_(True)
    torch.manual_seed(1)
    x = torch.randn(2, 16, a.latent_h, a.latent_w)
    w = torch.randn_like(x)  # a random linear read-out, so the loss depends on every output entry
    sigma = torch.tensor([0.8, 0.5])
    (c_e, c_p), (u_e, u_p) = _branch_embeddings(a, PROMPTS)
    embeds = a.encode_prompts(PROMPTS)
    with torch.no_grad():
        v_plain = SD3Adapter(a.pipe, height=a.height, width=a.width, max_sequence_length=MSL).velocity(
            x, sigma, embeds, s)
    v = a.velocity(x, sigma, embeds, s)
    torch.testing.assert_close(v.detach(), v_plain, rtol=0, atol=1e-5)  # same values either way
    got = _param_grads(tr, lambda: (a.velocity(x, sigma, embeds, s) * w).sum())
    g_c = _param_grads(tr, lambda: (_direct(tr, x, sigma * 1000, c_e, c_p) * w).sum())
    g_u = _param_grads(tr, lambda: (_direct(tr, x, sigma * 1000, u_e, u_p) * w).sum())
    expected = s * g_c if detach else (1 - s) * g_u + s * g_c
    other = (1 - s) * g_u + s * g_c if detach else s * g_c
    scale = float(expected.abs().max())
    # float32 summation order differs between one doubled batch and separate calls (measured ~1e-6 of scale)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * scale)
    assert float((got - other).abs().max()) > 1e-2 * scale  # the other convention is far off: it can fail


def test_bad_inputs(adapter):
    pipe = adapter.pipe
    with pytest.raises(ValueError, match="multiple of 16"):
        SD3Adapter(pipe, height=72, width=64)
    with pytest.raises(ValueError, match="max_sequence_length"):
        SD3Adapter(pipe, height=64, width=64, max_sequence_length=600)
    with pytest.raises(ValueError, match="3 generators for a batch of 2"):
        adapter.initial_latents(2, _generators([0, 1, 2]))
    with pytest.raises(ValueError, match="num_steps"):
        adapter.sigmas(0)
    with pytest.raises(ValueError, match="2 latents but 1 prompt"):
        adapter.velocity(torch.zeros(2, 16, 8, 8), torch.ones(2), adapter.encode_prompts(PROMPTS[:1]), 4.5)


def test_sd35_config_matches_flow_grpo_and_targets_exist(adapter):
    """configs/sd35_grpo.yaml carries Flow-GRPO's SD3.5-M GenEval settings (config/grpo.py ``geneval_sd3``,
    config/base.py), and its LoRA targets name modules of the SD3.5 transformer (joint attention only)."""
    cfg = load_config(REPO / "configs" / "sd35_grpo.yaml")
    assert cfg.model.pretrained == "stabilityai/stable-diffusion-3.5-medium"
    assert (cfg.model.height, cfg.model.width, cfg.model.dtype) == (512, 512, "bfloat16")
    assert (cfg.sampling.num_steps, cfg.eval_sampling.num_steps) == (10, 40)
    assert (cfg.sampling.noise_level, cfg.sampling.guidance_scale) == (0.7, 4.5)
    assert cfg.eval_sampling.guidance_scale == 4.5
    assert (cfg.train.group_size, cfg.batch_size, cfg.train.lr) == (24, 48 * 24, 3e-4)
    assert (cfg.objective.clip_range, cfg.objective.kl_beta, cfg.advantage.global_std) == (1e-4, 0.04, True)
    assert (cfg.model.finetune, cfg.model.lora_rank, cfg.model.lora_alpha) == ("lora", 32, 64)
    assert [r.name for r in cfg.rewards] == ["geneval"]
    names = [n for n, _ in adapter.transformer.named_modules()]
    for target in cfg.model.lora_target_modules:
        hits = [n for n in names if n.endswith("." + target)]
        assert hits and all(".attn2." not in n for n in hits), target


def _train(folder: Path, tmp_path: Path, *overrides: str) -> tuple[list[dict], Path]:
    from flowgrpo.runner import run

    prompt_file = tmp_path / "prompts.txt"
    prompt_file.write_text("\n".join(PROMPTS) + "\n")
    out = tmp_path / "run"
    cfg = build_config({}, [
        f"model.pretrained={folder}", f"model.max_sequence_length={MSL}", "model.height=64", "model.width=64",
        "sampling.num_steps=3", "sampling.guidance_scale=4.5", "eval_sampling.num_steps=3",
        "train.num_epochs=2", "train.group_size=2", "train.prompts_per_epoch=2", "train.rollout_batch_size=2",
        "train.lr=1e-3", "rewards=[{name: jpeg_compressibility}]", f"data.train_prompts={prompt_file}",
        f"output_dir={out}", "logging.progress=false", *overrides,
    ])
    run(cfg)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [0, 1]
    for r in records:
        assert r["policy/logprob_mismatch_max"] == 0.0  # rollout and training share the CFG forward exactly
        assert r["adv/abs_mean"] > 0  # the update had a signal
    return records, out


@torch.no_grad()
def _outputs(transformer, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 16, 8, 8, generator=g)
    e = torch.randn(1, 10, transformer.config.joint_attention_dim, generator=g)
    p = torch.randn(1, transformer.config.pooled_projection_dim, generator=g)
    return _direct(transformer, x, torch.tensor([500.0]), e, p)


def test_train_lora_through_saved_folder(folder, tmp_path):
    _, out = _train(folder, tmp_path, "model.finetune=lora", "model.lora_rank=4", "model.lora_alpha=8")
    base = StableDiffusion3Pipeline.from_pretrained(folder)
    before = _outputs(base.transformer)
    base.load_lora_weights(out / "lora")  # the saved LoRA loads through diffusers' SD3 LoRA loader
    assert float((_outputs(base.transformer) - before).abs().max()) > 1e-6


def test_train_full_with_kl_through_saved_folder(folder, tmp_path):
    records, out = _train(folder, tmp_path, "model.finetune=full", "objective.kl_beta=0.1")
    assert all("policy/kl_ref" in r for r in records)
    trained = SD3Transformer2DModel.from_pretrained(out / "transformer")
    original = SD3Transformer2DModel.from_pretrained(folder / "transformer")
    with torch.no_grad():
        pairs = zip(trained.parameters(), original.parameters(), strict=True)
        diffs = [float((a - b).abs().max()) for a, b in pairs]
    assert max(diffs) > 1e-5
