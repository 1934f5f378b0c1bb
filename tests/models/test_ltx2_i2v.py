"""LTX-2 image-to-video (``LTX2ImageToVideoPipeline``) beyond the shared conformance suite (its case,
``TestLTX2I2V`` in tests/models/test_conformance.py, runs parity, exact log-probs, LoRA and the GRPO and
DiffusionNFT epochs): the image is latent frame 0 of the video, held clean by the pipeline, so it is never in the
sampled state; the decoder gets it back from the rows' embeddings; the other objective families train an epoch."""

from __future__ import annotations

import importlib
import json

import pytest
import torch

from flowgrpo.models.random_pipelines import CASES

CASE = CASES["ltx2_i2v"]


@pytest.fixture(autouse=True)
def _one_thread_and_patches(monkeypatch):
    """One intra-op thread (tiny models), and the case's module patches (the STG block of the two-block model)
    as the conformance suite sets them."""
    for target, value in CASE.module_patches.items():
        module, attr = target.split(":")
        monkeypatch.setattr(importlib.import_module(module), attr, value)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _adapter(tmp_path_factory):
    from flowgrpo.models import load_model
    from flowgrpo.testing.adapters import tiny_folder

    folder = tiny_folder(CASE, tmp_path_factory)
    return folder, load_model(str(folder), height=CASE.size, width=CASE.size,
                              max_sequence_length=CASE.max_sequence_length, **CASE.load_kwargs)


def _images(folder, n: int = 2, seed: int = 0) -> list:
    """n PNG files of the case's size (different images) in ``folder``."""
    from PIL import Image

    from flowgrpo.testing.rewards import default_images

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, img in enumerate(default_images(n, CASE.size, CASE.size, torch.Generator().manual_seed(seed))):
        paths.append(folder / f"{i}.png")
        Image.fromarray((img.permute(1, 2, 0) * 255).round().byte().numpy()).save(paths[-1])
    return paths


def _frame0_by_hand(adapter, path) -> torch.Tensor:
    """(h·w, C) the image's latent frame as packed tokens, from the VAE directly: [−1, 1] pixels (the test images
    are already the output size), the posterior's mode, (z − latents_mean)/latents_std per channel, then the
    tokens in (row, column) order with the C channels as features (patch size 1)."""
    import numpy as np
    from PIL import Image

    vae = adapter.pipe.vae
    img = np.asarray(Image.open(path).convert("RGB")).copy()
    pixels = torch.from_numpy(img).permute(2, 0, 1)[None, :, None].float() / 127.5 - 1  # (1, 3, 1, H, W)
    with torch.no_grad():
        z = vae.encode(pixels).latent_dist.mode()[0, :, 0]  # (C, h, w)
    z = (z - vae.latents_mean.view(-1, 1, 1)) / vae.latents_std.view(-1, 1, 1)
    return z.permute(1, 2, 0).reshape(-1, z.shape[0])


def test_the_conditioning_frame_is_a_fixed_input_never_in_the_sampled_state(tmp_path_factory, tmp_path):
    """Every transformer call sees the image's latent frame (equal to the VAE's encoding by hand) as the first h·w
    video tokens at video timestep 0, the other tokens at t = 1000·σ > 0, whatever the SDE noise; the sampled state
    (whose transitions carry the log-probs) is the other video tokens and the audio only; two rollouts with other
    SDE noise differ in the state and see the same frame 0; each row sees its own image."""
    from flowgrpo.config import SamplingConfig
    from flowgrpo.sampling.rollout import denoise, encode_rows

    _, adapter = _adapter(tmp_path_factory)
    adapter.image_crf = 0  # the frame by hand has no H.264 round trip (the suite's parity covers the CRF path)
    paths = _images(tmp_path / "img")
    expected = torch.stack([_frame0_by_hand(adapter, p) for p in paths])  # (2, h·w, C)
    n0, d = expected.shape[1:]
    s_v = adapter.video_tokens
    assert n0 == s_v // adapter.grid[0] and d == adapter.video_dim
    assert adapter.latent_shape == ((s_v - n0) * d + adapter.audio_frames * adapter.audio_dim,)
    seen = []
    hook = adapter.transformer.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append((kw["hidden_states"].detach().clone(), kw["timestep"].detach().clone(),
                                        kw["audio_timestep"].detach().clone())), with_kwargs=True)
    settings = SamplingConfig(num_steps=CASE.num_steps, guidance_scale=CASE.guidance_scale, sde_kind="flow_sde",
                               noise_level=0.7)
    ends = []
    try:
        for sde_seed in (100, 200):
            seen.clear()
            x0 = adapter.initial_latents(2, [torch.Generator().manual_seed(s) for s in (1, 2)])
            with torch.no_grad():
                embeds = encode_rows(adapter, list(CASE.prompts), [{"images": [str(p)]} for p in paths])
                xs, log_probs, stochastic = denoise(
                    adapter, x0, embeds, adapter.sigmas(CASE.num_steps), settings,
                    torch.ones(CASE.num_steps, dtype=torch.bool),
                    [torch.Generator().manual_seed(sde_seed + i) for i in range(2)])
            assert xs.shape == (2, CASE.num_steps + 1, *adapter.latent_shape)
            assert torch.isfinite(log_probs).all() and stochastic.all()
            assert len(seen) == 3 * CASE.num_steps  # CFG (one doubled call), STG and modality isolation a step
            for hidden, t_video, t_audio in seen:
                assert hidden.shape[1:] == (s_v, d) and t_video.shape == (hidden.shape[0], s_v)
                for r in range(hidden.shape[0]):  # [uncond ‖ cond] rows, or the two positive rows alone
                    torch.testing.assert_close(hidden[r, :n0].float(), expected[r % 2], rtol=0, atol=1e-5)
                assert (t_video[:, :n0] == 0).all()
                assert (t_video[:, n0:] == t_audio[:, None]).all() and (t_audio > 0).all()
            ends.append(xs[:, -1])
    finally:
        hook.remove()
    assert float((ends[0] - ends[1]).abs().max()) > 1e-3  # the SDE noise moved the state
    assert float((expected[0] - expected[1]).abs().max()) > 1e-3  # each row sees its own image


def test_decode_puts_the_rows_conditioning_frame_back(tmp_path_factory, tmp_path):
    """The same clean state decoded with two rows' embeddings gives two videos that differ (the image frame is
    theirs), equal to the text-to-video adapter's decode of the joint latents [frame 0 ‖ state] (the same folder
    loaded as ``LTX2Pipeline``); the rollout's ``decode_and_report`` gives the same, given the embeddings or
    encoding the records itself (E-GRPO's branches); without embeddings decode refuses in one line; the gradient
    of the decode reaches the state (ReFL's ``decode_with_grad``)."""
    from diffusers import LTX2Pipeline

    from flowgrpo.algo.objectives.paths import decode_with_grad
    from flowgrpo.config import SamplingConfig
    from flowgrpo.models.ltx2 import LTX2Adapter
    from flowgrpo.sampling.rollout import RolloutRequest, decode_and_report, encode_rows

    folder, adapter = _adapter(tmp_path_factory)
    paths = _images(tmp_path / "img")
    embeds = encode_rows(adapter, [CASE.prompts[0]] * 2, [{"images": [str(p)]} for p in paths])
    x = adapter.initial_latents(1, [torch.Generator().manual_seed(4)]).expand(2, -1).contiguous()
    videos = adapter.decode(x, embeds)
    assert videos.shape == (2, CASE.num_frames, 3, CASE.size, CASE.size)
    assert float((videos[0] - videos[1]).abs().max()) > 1e-3
    t2v = LTX2Adapter(LTX2Pipeline.from_pretrained(str(folder)), height=CASE.size, width=CASE.size,
                      num_frames=CASE.num_frames, max_sequence_length=CASE.max_sequence_length)
    joint = torch.cat([embeds["image_tokens"].flatten(1), x], dim=1)  # the text-to-video layout
    torch.testing.assert_close(videos, t2v.decode(joint), rtol=0, atol=0)
    with pytest.raises(ValueError, match="decodes with its rows' embeddings .*got none for 2 latents"):
        adapter.decode(x)
    meta = [{"images": [str(p)]} for p in paths]
    request = RolloutRequest(prompts=[CASE.prompts[0]] * 2, metadata=meta, prompt_ids=torch.tensor([0, 1]),
                             sample_index=torch.tensor([0, 0]), settings=SamplingConfig(num_steps=1, guidance_scale=1.0),  # noqa: E501
                             batch_size=2, seed=0, epoch=0)
    for rows in (embeds, None):
        got = decode_and_report(adapter, x, request.prompts, meta, request, rows)
        torch.testing.assert_close(got, videos, rtol=0, atol=0)
    z = x[:1].clone().requires_grad_(True)
    decode_with_grad(adapter, z, embeds.index(slice(0, 1))).mean().backward()
    assert z.grad is not None and float(z.grad.abs().max()) > 0


def _prompt_file(tmp_path) -> str:
    paths = _images(tmp_path / "img")
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": p, "image": f"img/{i}.png"}) + "\n"
                         for i, (p, _) in enumerate(zip(CASE.prompts, paths, strict=True))))
    return str(f)


def _teacher(tmp_path, folder) -> str:
    """The tiny pipeline's transformer with every weight moved by 2 % (a ``from_pretrained`` folder)."""
    from diffusers import LTX2VideoTransformer3DModel

    tr = LTX2VideoTransformer3DModel.from_pretrained(str(folder / "transformer"))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in tr.parameters():
            p.mul_(1 + 0.02 * torch.randn(p.shape, generator=g))
    tr.save_pretrained(str(tmp_path / "teacher"))
    return str(tmp_path / "teacher")


@pytest.mark.parametrize("family", ["path", "prefs"])
def test_one_epoch_of_the_path_and_preference_objectives(family, tmp_path_factory, tmp_path):
    """The objective families the suite's epochs (GRPO per_step / chunk, DiffusionNFT) leave out, one epoch each
    through the real trainer with the prompt file's images: on-policy distillation (path: a teacher of moved
    weights scores the student's own Euler path, decoded with the rows' conditioning frame) and online
    Diffusion-DPO (preferences: best against worst of each group). ReFL / DRaFT need a differentiable reward,
    and no video reward has one: its decode with gradient is checked above."""
    from flowgrpo.config import build_config
    from flowgrpo.runner import run
    from flowgrpo.testing.adapters import tiny_folder

    folder = tiny_folder(CASE, tmp_path_factory)
    objective = (f"objective={{name: opd, teacher: {_teacher(tmp_path, folder)}}}" if family == "path"
                 else "objective={name: dpo}")
    out = tmp_path / "run"
    run(build_config({}, [
        f"model.pretrained={folder}", f"model.max_sequence_length={CASE.max_sequence_length}",
        f"model.height={CASE.size}", f"model.width={CASE.size}", f"model.num_frames={CASE.num_frames}",
        "model.lora_rank=4", "model.lora_alpha=8", f"sampling.num_steps={CASE.num_steps}",
        f"sampling.guidance_scale={CASE.guidance_scale}", objective, "train.num_epochs=1",
        "train.group_size=2", "train.prompts_per_epoch=2", "train.rollout_batch_size=2", "train.lr=1e-3",
        f"data.train_prompts={_prompt_file(tmp_path)}", f"output_dir={out}", "logging.progress=false",
        "data.eval_num_prompts=2", f"eval_sampling.num_steps={CASE.num_steps}",
        "rewards=[{name: video_frames, kwargs: {base: jpeg_compressibility}}]"]))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [0]
    assert records[0]["objective/rows"] > 0 and records[0]["policy/grad_norm"] > 0
    assert (out / "lora" / "pytorch_lora_weights.safetensors").is_file()


def test_what_the_ltx2_i2v_adapter_refuses(tmp_path_factory):
    """One-line errors where the input enters: a record without its image, two images for one video, a patch
    size the pipeline's conditioning mask cannot pack, a negative CRF, and the two-expert settings."""
    from diffusers import LTX2ImageToVideoPipeline
    from PIL import Image

    from flowgrpo.models.ltx2_i2v import LTX2I2VAdapter, load_ltx2_i2v_adapter
    from flowgrpo.sampling.rollout import encode_rows

    folder, adapter = _adapter(tmp_path_factory)
    with pytest.raises(ValueError, match="LTX2ImageToVideoPipeline conditions every sample on an image \\(its first "
                       "frame\\), but the prompt record 'a red cube' has none"):
        encode_rows(adapter, ["a red cube"], [{}])
    img = Image.new("RGB", (32, 32))
    with pytest.raises(ValueError, match="exactly one image per prompt, got \\[2\\]"):
        adapter.encode_prompts(["a red cube"], images=[[img, img]])
    pipe = LTX2ImageToVideoPipeline.from_pretrained(str(folder))
    with pytest.raises(ValueError, match="image_crf must be >= 0"):
        LTX2I2VAdapter(pipe, height=32, width=32, num_frames=9, max_sequence_length=16, image_crf=-1)
    pipe.transformer_spatial_patch_size = 2
    with pytest.raises(ValueError, match="patch sizes 1 x 1.*got patch_size 2"):
        LTX2I2VAdapter(pipe, height=64, width=64, num_frames=9, max_sequence_length=16)
    with pytest.raises(ValueError, match="one transformer"):
        load_ltx2_i2v_adapter(str(folder), dtype=torch.float32, height=32, width=32, max_sequence_length=16,
                              num_frames=9, trained_expert="transformer_2")
