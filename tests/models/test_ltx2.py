"""LTX-2 text-to-video (``LTX2Pipeline``) through the shared adapter conformance suite: the sampled state is the
joint (video, audio) latents, compared with the pipeline's own video and audio latents after every step."""

from __future__ import annotations

import importlib

import pytest
import torch

from flowgrpo.models.random_pipelines import CASES
from flowgrpo.testing.adapters import AdapterConformance
from tests.tiny_runs import _one_thread  # noqa: F401 - autouse here


class TestLTX2(AdapterConformance):
    case = CASES["ltx2"]


def _tiny_adapter(tmp_path_factory, monkeypatch):
    from flowgrpo.models import load_model
    from flowgrpo.testing.adapters import tiny_folder

    case = CASES["ltx2"]
    for target, value in case.module_patches.items():
        module, attr = target.split(":")
        monkeypatch.setattr(importlib.import_module(module), attr, value)
    folder = tiny_folder(case, tmp_path_factory)
    return folder, load_model(str(folder), height=case.size, width=case.size,
                              max_sequence_length=case.max_sequence_length, num_frames=case.num_frames)


def test_the_video_velocity_depends_on_the_audio_state_so_both_are_sampled(tmp_path_factory, monkeypatch):
    """The state is [video ‖ audio]: changing only its audio part changes the video part of the velocity (the
    transformer's audio-to-video cross-attention), so a video-only state could not reproduce the pipeline; and the
    SDE noises the audio part too (two rollouts with different SDE noise differ in it)."""
    from flowgrpo.config import SamplingConfig
    from flowgrpo.sampling.rollout import denoise, encode_rows

    _, adapter = _tiny_adapter(tmp_path_factory, monkeypatch)
    case = CASES["ltx2"]
    n_video = adapter.video_tokens * adapter.video_dim
    x = adapter.initial_latents(2, [torch.Generator().manual_seed(s) for s in (1, 2)])
    assert x.shape == (2, n_video + adapter.audio_frames * adapter.audio_dim)
    embeds = encode_rows(adapter, list(case.prompts), [{}, {}])
    y = x.clone()
    y[:, n_video:] += 0.5 * torch.randn(y[:, n_video:].shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        vx = adapter.velocity(x, torch.full((2,), 0.8), embeds, case.guidance_scale)
        vy = adapter.velocity(y, torch.full((2,), 0.8), embeds, case.guidance_scale)
    assert float((vx[:, :n_video] - vy[:, :n_video]).abs().max()) > 1e-4
    settings = SamplingConfig(num_steps=case.num_steps, guidance_scale=case.guidance_scale, sde_kind="flow_sde",
                               noise_level=0.7)
    ends = []
    for seed in (100, 200):
        with torch.no_grad():
            xs, log_probs, _ = denoise(adapter, x, embeds, adapter.sigmas(case.num_steps), settings,
                                       torch.ones(case.num_steps, dtype=torch.bool),
                                       [torch.Generator().manual_seed(seed + i) for i in range(2)])
        assert torch.isfinite(log_probs).all()
        ends.append(xs[:, -1])
    assert float((ends[0][:, n_video:] - ends[1][:, n_video:]).abs().max()) > 1e-3


def test_flowgrpo_sample_writes_ltx2_videos(tmp_path_factory, tmp_path, monkeypatch):
    """``flowgrpo sample`` on the tiny LTX-2 model writes a GIF per video (every frame) and the exact frames."""
    from PIL import Image

    from flowgrpo.cli import main

    folder, _ = _tiny_adapter(tmp_path_factory, monkeypatch)
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red cube\ntwo green dogs\n")
    main(["sample", "--model", str(folder), "--height", "32", "--width", "32", "--num-frames", "9",
          "--max-sequence-length", "16", "--num-steps", "2", "--prompts", str(prompts), "--out", str(tmp_path / "out")])
    videos = torch.load(tmp_path / "out" / "images.pt")
    assert videos.shape == (2, 9, 3, 32, 32)
    gif = Image.open(tmp_path / "out" / "00001.gif")
    assert gif.n_frames == 9 and gif.size == (32, 32)


def test_what_the_ltx2_adapter_refuses(tmp_path_factory, monkeypatch):
    """One-line errors at the boundary: the released STG block (28) on a two-block transformer, a frame count that
    is not 1 + 8k, and the two-expert settings of another family."""
    from diffusers import LTX2Pipeline

    from flowgrpo.models.ltx2 import LTX2Adapter, LTX2Guidance, load_ltx2_adapter

    folder, _ = _tiny_adapter(tmp_path_factory, monkeypatch)
    pipe = LTX2Pipeline.from_pretrained(str(folder))
    with pytest.raises(ValueError, match=r"guidance blocks \[28\] are not all blocks of this transformer \(0\.\.1\)"):
        LTX2Adapter(pipe, height=32, width=32, num_frames=9, max_sequence_length=16, guidance=LTX2Guidance())
    with pytest.raises(ValueError, match="num_frames must be 1 \\+ a multiple of 8"):
        LTX2Adapter(pipe, height=32, width=32, num_frames=5, max_sequence_length=16)
    with pytest.raises(ValueError, match="one transformer"):
        load_ltx2_adapter(str(folder), dtype=torch.float32, height=32, width=32, max_sequence_length=16,
                          num_frames=9, guidance_scale_2=2.0)
