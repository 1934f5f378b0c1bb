"""Random pipelines of every supported model family, built offline in the real diffusers folder format.

Two uses:

* the adapter conformance suite (:mod:`flowgrpo.testing.adapters`) builds each family's tiny pipeline from
  its :class:`ConformanceCase` in :data:`CASES`;
* benchmarks build a random pipeline at any size with :func:`build_random_pipeline` (``transformer_kwargs``
  override the tiny transformer's configuration, e.g. the real model's layer count and widths), then load it
  through ``from_pretrained`` like a downloaded folder.

    python -m flowgrpo.models.random_pipelines qwenimage OUT_DIR [--size 64] [--transformer '{"num_layers": 4}']
    [--real-size]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from flowgrpo.argtypes import OneLineParser
from flowgrpo.writing.outputs import claim_for_command

logger = logging.getLogger(__name__)

_PROMPTS = ("a red cube on a blue table", "two green dogs")


@dataclass(frozen=True)
class ConformanceCase:
    """How the conformance suite builds, loads and calls one model family.

    Attributes:
        name: a short label (test ids, temporary folder names).
        build: ``build(out_dir) -> folder``: writes the tiny random pipeline with ``save_pretrained``.
        size: image height = width in pixels for every test.
        max_sequence_length: text tokens per prompt, passed to ``load_model`` and to the pipeline.
        guidance_scale: the guidance of the parity and training runs (true CFG scale or guidance embedding).
        call_kwargs: ``call_kwargs(guidance_scale) -> dict``: the pipeline-specific ``__call__`` arguments that
            select this guidance and the adapter's conventions (e.g. ``{"true_cfg_scale": s, "negative_prompt":
            " "}``); prompt, generator, steps, size and output type are added by the suite.
        lora_target_modules: peft target modules of the LoRA tests (must exist in the transformer).
        num_steps: T of the parity and training runs.
        parity_atol: tolerance of the pipeline-parity test (latents and images).
        prompts: two different prompts.
        load_kwargs: extra keyword arguments of :func:`flowgrpo.models.load_model`.
        condition: editing models only: ``condition(images) -> dict``, the ``__call__`` arguments that pass B
            lists of source PIL images (one list per prompt) the way the adapter uses them; None for
            text-to-image models.
        pipeline_batch_size: prompts per ``__call__`` when the pipeline takes fewer than the test's two
            (Qwen-Image-Edit-Plus: 1); None: all at once.
        module_patches: ``{"module:ATTR": value}`` set for the suite's duration (pipeline-module constants,
            e.g. a conditioning image area, scaled down to the tiny model); the adapter must read them the
            same way the pipeline does.
        num_frames: video models: F, the frames of every test video (also in ``load_kwargs`` and
            ``call_kwargs``); None for image models.
        pipeline_setup: ``pipeline_setup(pipe, guidance_scale)`` before each ``__call__``, for a pipeline whose
            guidance is a component rather than a call argument (HunyuanVideo-1.5's and the modular pipelines'
            guider); None: nothing.
        load_pipeline: ``load_pipeline(folder) -> pipeline`` for the LoRA clause's fresh pipeline, when it is not
            ``type(adapter.pipe).from_pretrained(folder)`` (a modular pipeline: blocks chosen, components loaded);
            None: that.
        guided: the guidance scale changes the velocity; False for a model sampled without guidance (a
            step-distilled one), whose guidance clause is skipped.
        forward_objective: also train one epoch with a forward-process objective (DiffusionNFT); off for the
            families that have it covered elsewhere (tests/training/test_forward_runs.py), to keep the suite's budget.
        pipeline_images: ``pipeline_images(images) -> images`` maps the pipeline's output to what the adapter
            decodes, when they differ by a documented convention (Qwen-Image 2.1: RGBA → its RGB channels); None:
            the same.
        call_takes_size: ``__call__`` takes ``height`` and ``width``; False for a pipeline that sizes its output
            from the conditioning image (HunyuanVideo-1.5 image-to-video), whose case must give images that size.
        callback_state: ``callback_state(callback_kwargs) -> tensor``: the adapter's sampled state from the
            tensors ``callback_on_step_end`` receives, for a state that is more than the pipeline's ``latents``
            (LTX-2: video and audio latents); None: ``callback_kwargs["latents"]``.
    """

    name: str
    build: Callable[[Path], Path]
    size: int
    max_sequence_length: int
    guidance_scale: float
    call_kwargs: Callable[[float], dict]
    lora_target_modules: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")
    num_steps: int = 3
    parity_atol: float = 1e-6
    prompts: tuple[str, ...] = _PROMPTS
    load_kwargs: dict = field(default_factory=dict)
    condition: Callable[[list[list]], dict] | None = None
    pipeline_batch_size: int | None = None
    module_patches: dict = field(default_factory=dict)
    num_frames: int | None = None
    pipeline_setup: Callable | None = None
    call_takes_size: bool = True
    load_pipeline: Callable[[Path], object] | None = None
    guided: bool = True
    forward_objective: bool = False
    pipeline_images: Callable | None = None
    callback_state: Callable[[dict], object] | None = None

    @contextlib.contextmanager
    def patched(self):
        """Inside: the case's ``module_patches`` set (the pipeline and the adapter read them), restored after."""
        saved = []
        try:
            for target, value in self.module_patches.items():
                module, attr = target.split(":")
                module = importlib.import_module(module)
                saved.append((module, attr, getattr(module, attr)))
                setattr(module, attr, value)
            yield self
        finally:
            for module, attr, value in reversed(saved):
                setattr(module, attr, value)


def _words() -> list[str]:
    return " ".join(_PROMPTS).split()


def _builder(target: str) -> Callable[..., Path]:
    """``build(out_dir, *, sample_size, seed, transformer_kwargs) -> folder``: the family's tiny-pipeline builder
    ``module:function`` (imported on first use, so listing the families loads none), with the conformance
    prompts' words as the tokenizers' vocabulary and the builder's own default size."""
    module, name = target.split(":")

    def build(out: Path, **kwargs) -> Path:
        return getattr(importlib.import_module(module), name)(out, words=_words(), **kwargs)

    return build


_EDIT_PLUS = "diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus"

#: name → builder ``(out_dir, *, sample_size, seed, transformer_kwargs) -> folder``
BUILDERS: dict[str, Callable[..., Path]] = {
    "flux": _builder("flowgrpo.models.tiny:build_tiny_flux"),
    "sd3": _builder("flowgrpo.models.sd3:build_tiny_sd3"),
    "qwenimage": _builder("flowgrpo.models.qwenimage:build_tiny_qwenimage"),
    "zimage": _builder("flowgrpo.models.zimage:build_tiny_zimage"),
    "flux2_klein": _builder("flowgrpo.models.flux2:build_tiny_flux2_klein"),
    "flux2": _builder("flowgrpo.models.flux2:build_tiny_flux2"),
    "kontext": _builder("flowgrpo.models.kontext:build_tiny_kontext"),
    "qwenimage_edit_plus": _builder("flowgrpo.models.qwenimage_edit:build_tiny_qwenimage_edit_plus"),
    "wan21": _builder("flowgrpo.models.wan:build_tiny_wan"),
    "wan22": lambda out, **kw: _builder("flowgrpo.models.wan:build_tiny_wan")(out, variant="wan22", **kw),
    "wan22_ti2v": lambda out, **kw: _builder("flowgrpo.models.wan:build_tiny_wan")(out, variant="ti2v", **kw),
    "hunyuan_video15": _builder("flowgrpo.models.hunyuan_video15:build_tiny_hunyuan_video15"),
    "wan21_i2v": _builder("flowgrpo.models.wan_i2v:build_tiny_wan_i2v"),
    "wan22_i2v": lambda out, **kw: _builder("flowgrpo.models.wan_i2v:build_tiny_wan_i2v")(out, variant="wan22", **kw),
    "hunyuan_video15_i2v": _builder("flowgrpo.models.hunyuan_video15:build_tiny_hunyuan_video15_i2v"),
    "qwenimage21": _builder("flowgrpo.models.qwenimage21:build_tiny_qwenimage21"),
    "flux3": _builder("flowgrpo.models.flux3:build_tiny_flux3"),
    "flux3_distilled": lambda out, **kw: _builder("flowgrpo.models.flux3:build_tiny_flux3")(out, distilled=True, **kw),
    "ltx2": _builder("flowgrpo.models.ltx2:build_tiny_ltx2"),
    "ltx2_i2v": _builder("flowgrpo.models.ltx2_i2v:build_tiny_ltx2_i2v"),
}

def _text_case(name: str, size: int, max_sequence_length: int, guidance_scale: float) -> ConformanceCase:
    """The case of a text-to-image family whose pipeline takes ``guidance_scale`` and ``max_sequence_length``."""
    return ConformanceCase(
        name=name, build=BUILDERS[name], size=size, max_sequence_length=max_sequence_length,
        guidance_scale=guidance_scale,
        call_kwargs=lambda s: {"guidance_scale": s, "max_sequence_length": max_sequence_length},
    )


def _video_case(name: str, size: int, guidance_scale: float, num_frames: int = 5) -> ConformanceCase:
    """The case of a text-to-video family whose pipeline takes ``guidance_scale``, ``num_frames`` and
    ``max_sequence_length`` (Wan)."""
    return ConformanceCase(
        name=name, build=BUILDERS[name], size=size, max_sequence_length=16, guidance_scale=guidance_scale,
        call_kwargs=lambda s: {"guidance_scale": s, "max_sequence_length": 16, "num_frames": num_frames},
        load_kwargs={"num_frames": num_frames}, num_frames=num_frames,
    )


def _i2v_case(name: str, size: int, guidance_scale: float, num_frames: int = 5) -> ConformanceCase:
    """The case of an image-to-video family whose pipeline takes one ``image`` per call (the first frame's),
    ``guidance_scale``, ``num_frames`` and ``max_sequence_length`` (Wan I2V)."""
    return ConformanceCase(
        name=name, build=BUILDERS[name], size=size, max_sequence_length=16, guidance_scale=guidance_scale,
        call_kwargs=lambda s: {"guidance_scale": s, "max_sequence_length": 16, "num_frames": num_frames},
        condition=lambda images: {"image": images[0][0]}, pipeline_batch_size=1,
        load_kwargs={"num_frames": num_frames}, num_frames=num_frames,
    )


def _hunyuan_guider(pipe, guidance_scale: float) -> None:
    """HunyuanVideo-1.5 takes its CFG scale from its guider component, not from ``__call__``."""
    from diffusers import ClassifierFreeGuidance

    pipe.guider = ClassifierFreeGuidance(guidance_scale=guidance_scale)


def _modular_guider(pipe, guidance_scale: float) -> None:
    """A modular pipeline takes its CFG scale from its guider component (diffusers' ``ClassifierFreeGuidance``)."""
    from diffusers import ClassifierFreeGuidance

    pipe.update_components(guider=ClassifierFreeGuidance(guidance_scale=guidance_scale))


def _load_flux3_pipeline(folder: Path):
    """The modular FLUX.3 pipeline as its adapter loads it: without the prompt upsampler, components in float32."""
    import torch

    from flowgrpo.models.modular import load_modular_pipeline

    return load_modular_pipeline(str(folder), dtype=torch.float32, drop_blocks=("prompt_upsampler",))


def _flux3_case(name: str, guidance_scale: float) -> ConformanceCase:
    """A modular FLUX.3 case: one prompt per pipeline call (the text encoder block takes one), the guidance as the
    pipeline's guider, the transformer's attention projections and feed-forwards as LoRA targets."""
    return ConformanceCase(
        name=name, build=BUILDERS[name], size=32, max_sequence_length=512, guidance_scale=guidance_scale,
        call_kwargs=lambda s: {"max_sequence_length": 512}, pipeline_batch_size=1,
        pipeline_setup=None if name.endswith("distilled") else _modular_guider, load_pipeline=_load_flux3_pipeline,
        guided=not name.endswith("distilled"), forward_objective=True,
        # the pipeline's first step feeds the transformer the transposed view of its noise, the adapter contiguous
        # tokens (as the rollout and the update both do): another matmul kernel, measured 7e-7 on the first velocity
        # and 1.5e-6 on the decoded images (2026-12-02, torch 2.14.1 CPU)
        parity_atol=2e-6,
    )


def _ltx2_guidance():
    """The tiny LTX-2 case's guidance: the pipeline's defaults with the STG block scaled down to its two blocks."""
    from flowgrpo.models.ltx2 import LTX2Guidance

    return LTX2Guidance(stg_blocks=(1,))


def _ltx2_callback_inputs(pipe, guidance_scale: float) -> None:
    """Let ``LTX2Pipeline``'s step callback see ``audio_latents`` too (the adapter's state is video and audio; the
    pipeline's ``_callback_tensor_inputs`` lists the video latents only, and reads any name from its locals)."""
    if "audio_latents" not in pipe._callback_tensor_inputs:
        pipe._callback_tensor_inputs = [*type(pipe)._callback_tensor_inputs, "audio_latents"]


def _ltx2_state(kwargs: dict):
    """The LTX-2 adapter's joint state ``[video ‖ audio]`` (B, N) from the pipeline's step-callback tensors."""
    import torch

    return torch.cat([kwargs["latents"].flatten(1), kwargs["audio_latents"].flatten(1)], dim=1)


_LTX2_I2V = "diffusers.pipelines.ltx2.pipeline_ltx2_image2video"


def _ltx2_i2v_callback_inputs(pipe, guidance_scale: float) -> None:
    """Let ``LTX2ImageToVideoPipeline``'s step callback see ``audio_latents`` and ``conditioning_mask``."""
    names = ("audio_latents", "conditioning_mask")
    pipe._callback_tensor_inputs = [*type(pipe)._callback_tensor_inputs, *names]


def _ltx2_i2v_state(kwargs: dict):
    """The LTX-2 I2V adapter's state ``[generated video tokens ‖ audio]`` (B, N): the pipeline's packed video
    latents without the tokens its ``conditioning_mask`` marks (frame 0, the image), then the audio."""
    import torch

    video = kwargs["latents"]
    keep = kwargs["conditioning_mask"][0] == 0  # (S_v,) the same for every row (and doubled for CFG)
    return torch.cat([video[:, keep].flatten(1), kwargs["audio_latents"].flatten(1)], dim=1)


CASES: dict[str, ConformanceCase] = {case.name: case for case in (
    _text_case("flux", 64, 32, 3.5),
    _text_case("sd3", 64, 12, 4.5),
    ConformanceCase(
        name="qwenimage", build=BUILDERS["qwenimage"], size=32, max_sequence_length=64, guidance_scale=4.0,
        call_kwargs=lambda s: {"true_cfg_scale": s, "negative_prompt": [" "] * 2, "max_sequence_length": 64},
    ),
    _text_case("zimage", 32, 64, 4.0),
    _text_case("flux2_klein", 32, 32, 4.0),
    _text_case("flux2", 32, 64, 4.0),
    ConformanceCase(
        name="kontext", build=BUILDERS["kontext"], size=64, max_sequence_length=32, guidance_scale=2.5,
        prompts=("make the cube red", "add two dogs"),
        call_kwargs=lambda s: {"guidance_scale": s, "max_sequence_length": 32, "max_area": 64 * 64},
        # one source per prompt at the output size, no snapping to Kontext's preferred resolutions
        condition=lambda images: {"image": [imgs[0] for imgs in images], "_auto_resize": False},
    ),
    ConformanceCase(
        name="qwenimage_edit_plus", build=BUILDERS["qwenimage_edit_plus"], size=32, max_sequence_length=64,
        guidance_scale=4.0, prompts=("make the cube red", "add two dogs"),
        call_kwargs=lambda s: {"true_cfg_scale": s, "negative_prompt": " "},
        condition=lambda images: {"image": images[0]}, pipeline_batch_size=1,
        # the pipeline's 384² (vision encoder) and 1024² (VAE) source areas, scaled to the tiny 32² model
        module_patches={f"{_EDIT_PLUS}:CONDITION_IMAGE_SIZE": 56 * 56, f"{_EDIT_PLUS}:VAE_IMAGE_SIZE": 32 * 32},
    ),
    _video_case("wan21", 32, 4.0),
    _video_case("wan22", 32, 4.0),  # 3 steps at shift 3: σ 1 on the high-noise expert, 0.75 and 0.009 on the low
    _video_case("wan22_ti2v", 64, 4.0),  # the 16x VAE: 64² frames are 2 x 2 tokens
    ConformanceCase(
        name="hunyuan_video15", build=BUILDERS["hunyuan_video15"], size=32, max_sequence_length=1000,
        guidance_scale=4.0, call_kwargs=lambda s: {"num_frames": 5}, load_kwargs={"num_frames": 5}, num_frames=5,
        pipeline_setup=_hunyuan_guider, pipeline_batch_size=1,  # its VAE decodes one video per call (0.42)
    ),
    _i2v_case("wan21_i2v", 32, 4.0),
    _i2v_case("wan22_i2v", 32, 4.0),  # 3 steps at shift 3: σ 1 on the high-noise expert, 0.75 and 0.009 on the low
    ConformanceCase(
        name="hunyuan_video15_i2v", build=BUILDERS["hunyuan_video15_i2v"], size=32, max_sequence_length=1000,
        guidance_scale=4.0,
        # no size argument: the pipeline sizes the video from the (square) image at target_size 32, i.e. 32²
        call_kwargs=lambda s: {"num_frames": 5}, load_kwargs={"num_frames": 5}, num_frames=5,
        condition=lambda images: {"image": images[0][0]}, pipeline_setup=_hunyuan_guider, pipeline_batch_size=1,
        call_takes_size=False,
    ),
    ConformanceCase(
        name="qwenimage21", build=BUILDERS["qwenimage21"], size=32, max_sequence_length=64, guidance_scale=4.0,
        call_kwargs=lambda s: {"true_cfg_scale": s, "negative_prompt": [" "] * 2},
        pipeline_images=lambda images: images[:, :3],  # the VAE decodes RGBA; the adapter gives its RGB channels
        forward_objective=True,
    ),
    _flux3_case("flux3", 3.5),
    _flux3_case("flux3_distilled", 1.0),
    ConformanceCase(
        name="ltx2", build=BUILDERS["ltx2"], size=32, max_sequence_length=16, guidance_scale=4.0,
        # the pipeline's guidance stack (CFG on x0, STG, modality isolation, rescale) with the STG block scaled
        # down to the tiny model's two blocks (the released default is block 28 of 48); decode noise off
        call_kwargs=lambda s: {"num_frames": 9, "max_sequence_length": 16, "guidance_scale": s,
                               "callback_on_step_end_tensor_inputs": ["latents", "audio_latents"],
                               **_ltx2_guidance().call_kwargs()},
        load_kwargs={"num_frames": 9}, num_frames=9, pipeline_setup=_ltx2_callback_inputs,
        module_patches={"flowgrpo.models.ltx2:DEFAULT_GUIDANCE": _ltx2_guidance()},
        callback_state=_ltx2_state,
    ),
    ConformanceCase(
        name="ltx2_i2v", build=BUILDERS["ltx2_i2v"], size=32, max_sequence_length=16, guidance_scale=4.0,
        # as "ltx2", with the first frame's image (one per call) re-compressed at the pipeline's default CRF (33)
        # by PyAV's H.264 round trip in both the pipeline and the adapter (PyAV: the test extra)
        call_kwargs=lambda s: {"num_frames": 9, "max_sequence_length": 16, "guidance_scale": s,
                               "callback_on_step_end_tensor_inputs": ["latents", "audio_latents", "conditioning_mask"],
                               **_ltx2_guidance().call_kwargs()},
        condition=lambda images: {"image": images[0][0]}, pipeline_batch_size=1,
        load_kwargs={"num_frames": 9}, num_frames=9, pipeline_setup=_ltx2_i2v_callback_inputs,
        module_patches={"flowgrpo.models.ltx2:DEFAULT_GUIDANCE": _ltx2_guidance()},
        callback_state=_ltx2_i2v_state, forward_objective=True,
    ),
)}


#: The released transformers' body sizes (blocks, heads, head width) per family, for ``transformer_kwargs``: a
#: random pipeline with the real model's per-step compute. Text and latent widths stay the tiny encoders' and
#: VAE's (they must match them). From the diffusers configs of FLUX.1-dev, SD3.5 Medium, Qwen-Image, Z-Image and
#: FLUX.2 [dev] (the last two are their classes' constructor defaults); FLUX.2 [klein] and Kontext (= FLUX.1) are
#: left to the caller.
REAL_SIZE: dict[str, dict] = {
    "flux": {"num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128, "num_attention_heads": 24,
             "axes_dims_rope": (16, 56, 56)},
    "sd3": {"num_layers": 24, "attention_head_dim": 64, "num_attention_heads": 24, "caption_projection_dim": 1536,
            "dual_attention_layers": tuple(range(13)), "pos_embed_max_size": 384},
    "qwenimage": {"num_layers": 60, "attention_head_dim": 128, "num_attention_heads": 24,
                  "axes_dims_rope": (16, 56, 56)},
    "zimage": {"dim": 3840, "n_layers": 30, "n_refiner_layers": 2, "n_heads": 30, "n_kv_heads": 30,
               "axes_dims": [32, 48, 48], "axes_lens": [1536, 512, 512]},
    "flux2": {"num_layers": 8, "num_single_layers": 48, "attention_head_dim": 128, "num_attention_heads": 48,
              "axes_dims_rope": (32, 32, 32, 32), "timestep_guidance_channels": 256},
}
# Wan2.1-T2V-1.3B, Wan2.2-T2V-A14B (each expert = Wan2.1-14B's body), Wan2.2-TI2V-5B and HunyuanVideo-1.5 (8.3 B):
# their diffusers transformer configs (text_dim / text widths stay the tiny encoders').
REAL_SIZE["wan21"] = {"num_layers": 30, "num_attention_heads": 12, "attention_head_dim": 128, "ffn_dim": 8960,
                      "freq_dim": 256, "rope_max_seq_len": 1024}
REAL_SIZE["wan22"] = {"num_layers": 40, "num_attention_heads": 40, "attention_head_dim": 128, "ffn_dim": 13824,
                      "freq_dim": 256, "rope_max_seq_len": 1024}
REAL_SIZE["wan22_ti2v"] = {"num_layers": 30, "num_attention_heads": 24, "attention_head_dim": 128, "ffn_dim": 14336,
                           "freq_dim": 256, "rope_max_seq_len": 1024}
REAL_SIZE["hunyuan_video15"] = {"num_layers": 54, "num_refiner_layers": 2, "num_attention_heads": 16,
                                "attention_head_dim": 128, "mlp_ratio": 4.0, "rope_axes_dim": (16, 56, 56)}
# FLUX.3 and Qwen-Image 2.1: their transformer classes' constructor defaults in diffusers 0.42.1 (no public
# config.json was found); the input and context widths stay the tiny VAE's and encoders'
REAL_SIZE["flux3"] = {"num_layers": 5, "num_single_layers": 28, "attention_head_dim": 128, "num_attention_heads": 24,
                      "mlp_ratio": 3.0, "axes_dims_rope": (32, 32, 32, 32), "timestep_channels": 256}
REAL_SIZE["flux3_distilled"] = REAL_SIZE["flux3"]
REAL_SIZE["qwenimage21"] = {"num_layers": 32, "attention_head_dim": 128, "num_attention_heads": 32, "mlp_ratio": 3,
                            "axes_dims_rope": (16, 56, 56)}
REAL_SIZE["kontext"] = REAL_SIZE["flux"]
# image-to-video: the 14B bodies (Wan2.1 I2V's image key/value projections at the real width) and HunyuanVideo-1.5's
REAL_SIZE["wan21_i2v"] = {**REAL_SIZE["wan22"], "added_kv_proj_dim": 5120}
REAL_SIZE["wan22_i2v"] = REAL_SIZE["wan22"]
REAL_SIZE["hunyuan_video15_i2v"] = REAL_SIZE["hunyuan_video15"]
REAL_SIZE["qwenimage_edit_plus"] = REAL_SIZE["qwenimage"]


def build_random_pipeline(name: str, out_dir: str | Path, *, sample_size: int | None = None, seed: int = 0,
                          transformer_kwargs: dict | None = None) -> Path:
    """Write a random pipeline of family ``name`` (a key of :data:`BUILDERS`) into ``out_dir``; return it.

    ``sample_size`` is the image size in pixels the VAE reports as native (default: the tiny size);
    ``transformer_kwargs`` override the tiny transformer's constructor arguments (layers, heads, widths), so
    the same builder gives a toy model for tests or a real-size random one for speed and memory benchmarks.
    Text encoders and VAE stay tiny (they run once per prompt / image, not once per step).

    Raises:
        ValueError: an unknown ``name``.
    """
    if name not in BUILDERS:
        raise ValueError(f"unknown model family {name!r}; known: {sorted(BUILDERS)}")
    kwargs = {"seed": seed, "transformer_kwargs": transformer_kwargs}
    if sample_size is not None:
        kwargs["sample_size"] = sample_size
    return BUILDERS[name](Path(out_dir), **kwargs)


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("family", choices=sorted(BUILDERS))
    parser.add_argument("out_dir")
    parser.add_argument("--size", type=int, default=None, help="native image size in pixels")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--transformer", default=None, help="JSON object of transformer constructor overrides")
    parser.add_argument("--real-size", action="store_true", help="the released transformer's body (REAL_SIZE)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    claim_for_command(parser, args.out_dir, "model")  # flowgrpo's write rule (flowgrpo.writing.outputs)
    if args.real_size and args.family not in REAL_SIZE:
        parser.error(f"no real size recorded for {args.family!r}; give --transformer")
    tk = {**(REAL_SIZE[args.family] if args.real_size else {}), **json.loads(args.transformer or "{}")} or None
    out = build_random_pipeline(args.family, args.out_dir, sample_size=args.size, seed=args.seed,
                                transformer_kwargs=tk)
    logger.info("random %s pipeline saved to %s", args.family, out)


if __name__ == "__main__":
    main()
