"""``flowgrpo plan``: the activation coefficients against the bytes autograd saves in the real block classes, the
plan's activations against a peak measured on the CPU, and the per-part bytes under mesh, context degree and
placements against hand computation from the released architectures' parameter counts."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re

import pytest
import torch

from flowgrpo.memory_plan.estimate import GIB, activation_bytes, plan, plan_config
from flowgrpo.memory_plan.families import COEFFICIENTS, FAMILIES, BlockKind, count_saved_bytes, sizes

REPO = __import__("pathlib").Path(__file__).resolve().parents[1]


#: a LoRA config switched to full fine-tuning: its LoRA settings back at their defaults (full fine-tuning reads
#: none of them, and a value set is refused)
FULL_FROM_LORA = ("model.finetune=full", "model.lora_rank=8", "model.lora_alpha=16",
                  "model.lora_target_modules=[to_q,to_k,to_v,to_out.0]")


@pytest.mark.parametrize("family", sorted(COEFFICIENTS))
def test_coefficients_are_the_bytes_autograd_saves(family):
    """Each block kind's (image, text) coefficients times (s_img, s_txt)·h give the bytes autograd saves in one
    block of the real class (narrow, bf16, counted by storage) at token counts other than those they were derived
    at, within 3 % (34·s·h, the old plan's figure, is 40 % under FLUX's)."""
    s_img, s_txt = 576, 96
    counted, h = count_saved_bytes(family, s_img, s_txt)
    assert set(counted) == set(COEFFICIENTS[family])
    for kind, (a, b) in COEFFICIENTS[family].items():
        formula = (a * s_img + b * s_txt) * h
        assert formula == pytest.approx(counted[kind], rel=0.03), (kind, formula, counted[kind])


def _live_peak(fn) -> int:
    """Peak bytes allocated by ``fn`` above what was live before it: the running sum of the CPU allocator's
    allocation and free events that torch's profiler records, in time order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = top = 0
    for _, n in events:
        live += n
        top = max(top, live)
    return top


LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "proj_mlp")


@pytest.mark.parametrize(("checkpointing", "lora"), [(False, False), (True, False), (False, True)])
def test_plan_activations_agree_with_a_measured_peak(checkpointing, lora):
    """A FLUX transformer of 2 double + 4 single blocks (2 heads of 128, bf16, every weight trainable, or a
    float32 LoRA of rank 16 over the frozen base) on one row of 1024 image + 128 text tokens: the peak the CPU
    allocator reaches over the forward and backward (the input gradient, so that no weight gradient is
    allocated) is the plan's activation figure within ±20 % (measured 93.1 / 22.7 / 81.6 MiB, planned 88.0 /
    19.2 / 72.9 MiB)."""
    from peft import LoraConfig

    from flowgrpo.memory_plan.families import _bf16, _flux1, lora_kinds

    s_img, s_txt, heads = 1024, 128, 2
    model = _bf16(_flux1(num_layers=2, num_single_layers=4, num_attention_heads=heads, joint_attention_dim=64,
                         pooled_projection_dim=32))
    if checkpointing:
        model.enable_gradient_checkpointing()
    if lora:
        model.requires_grad_(False)
        model.add_adapter(LoraConfig(r=16, lora_alpha=16, target_modules=list(LORA_TARGETS)))
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.data = p.data.float()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, s_img, 64, generator=g).to(torch.bfloat16).requires_grad_(True)
    text = torch.randn(1, s_txt, 64, generator=g).to(torch.bfloat16)
    pooled = torch.randn(1, 32, generator=g).to(torch.bfloat16)

    def forward_backward():
        out = model(hidden_states=x, encoder_hidden_states=text, pooled_projections=pooled, timestep=torch.ones(1),
                    guidance=torch.ones(1), img_ids=torch.zeros(s_img, 3), txt_ids=torch.zeros(s_txt, 3)).sample
        torch.autograd.grad(out.float().square().mean(), [x])

    # one thread: the CPU kernels' per-thread scratch buffers are not activations (with 2 threads the checkpointed
    # peak measured 24.3 MiB instead of 22.7), and a GPU has none of them
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        measured = _live_peak(forward_backward)
    finally:
        torch.set_num_threads(threads)
    c = COEFFICIENTS["flux"]
    if lora:  # planned for rank 16 at the released width 3072; the rank's term (4·15 bytes per token and adapted
        # linear, at most 4 a block here, over h) rescaled to this width
        extra = 4 * 15 * 4 * (1 / 256 - 1 / 3072)
        c = {k.name: (k.image + extra, k.text + extra) for k in lora_kinds("flux", 16, LORA_TARGETS)}
    narrow = dataclasses.replace(FAMILIES["flux"], width=128 * heads,
                                 kinds=(BlockKind("double", 2, *c["double"]), BlockKind("single", 4, *c["single"])))
    planned = activation_bytes(narrow, s_img, s_txt, checkpointing)
    assert 0.8 <= planned / measured <= 1.2, (planned, measured)


def _flux_dev_parameters() -> int:
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):  # FLUX.1-dev's transformer/config.json
        m = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
                                   attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                                   pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
    return sum(p.numel() for p in m.parameters())


def test_parts_follow_the_mesh_context_and_placements():
    """flux_chunk.yaml (FLUX.1-dev full fine-tuning, 720², 512 text tokens, train_batch_size 4, checkpointing):
    float32 masters, grads and Adam's two moments are 4 + 4 + 8 bytes a parameter over the shard × context ranks
    of one replica; HSDP replicas do not divide them; the context degree divides the activations; offload and
    an EMA on the CPU move their parts to host memory."""
    n = _flux_dev_parameters()
    assert n == sizes("flux").transformer
    cfg = REPO / "configs" / "flux_chunk.yaml"
    p8 = plan_config(cfg, 8)
    assert p8.device["masters"] == 4 * n / 8 and p8.device["grads"] == 4 * n / 8 and p8.device["weights"] == 0
    assert p8.device["optimizer"] == 8 * n / 8 and p8.host["masters"] == 0
    # 16 GPUs as 2 replicas of 8: the same shards per GPU
    p16 = plan_config(cfg, 16, overrides=["parallel.replicate=2"])
    assert p16.device["masters"] == p8.device["masters"] and p16.layout.fsdp == 8
    # context degree 2 on 8 GPUs: FSDP2 still shards over all 8, each rank keeps half a row's activations (at
    # 736², 46² image tokens: 720² makes 45² = 2025, which two processes cannot split, and the plan refuses)
    pc = plan_config(cfg, 8, overrides=["parallel.context_degree=2", "model.height=736", "model.width=736"])
    assert pc.device["masters"] == p8.device["masters"] and pc.layout.data == 4
    s_img, s_txt, h = (720 // 16) ** 2, 512, 3072

    def plain(s_img: int) -> float:
        return (19 * (56.2 * s_img + 56.1 * s_txt) + 38 * (50.1 * s_img + 50.1 * s_txt)) * h

    assert p8.activations_plain == pytest.approx(4 * plain(s_img))
    assert pc.activations_plain == pytest.approx(2 * plain((736 // 16) ** 2))
    per_row_ckpt = 57 * 2 * (s_img + s_txt) * h + (56.2 * s_img + 56.1 * s_txt) * h
    assert p8.device["activations"] == pytest.approx(4 * per_row_ckpt)
    # offload: trained parameters, grads and Adam in host memory; the EMA on the CPU
    po = plan_config(cfg, 8, overrides=["parallel.offload=cpu", "train.ema_decay=0.9", "parallel.ema=cpu"])
    for part, per_param in (("masters", 4), ("grads", 4), ("optimizer", 8), ("ema", 4)):
        assert po.device[part] == 0 and po.host[part] == per_param * n / 8, part
    assert po.phases["update"] == pytest.approx(p8.phases["update"] - 16 * n / 8)


def test_wan22_a14b_other_expert_and_text_encoder_placements():
    """Wan2.2 A14B (two 14 B experts, UMT5-XXL): the frozen expert in bf16 whole, sharded or offloaded; the text
    encoder sharded over the replica's ranks."""
    from diffusers import WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    with torch.device("meta"):  # Wan2.2-T2V-A14B's transformer/config.json (each expert)
        expert = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128,
                                       in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824,
                                       num_layers=40, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                       eps=1e-6, rope_max_seq_len=1024)
        umt5 = UMT5EncoderModel(UMT5Config(d_model=4096, d_ff=10240, num_layers=24, num_heads=64, d_kv=64,
                                           vocab_size=256384, feed_forward_proj="gated-gelu",
                                           is_encoder_decoder=False))
    n = sum(p.numel() for p in expert.parameters())
    e = sum(p.numel() for p in umt5.parameters())
    assert 13.5e9 < n < 14.5e9
    base = ["model.pretrained=Wan-AI/Wan2.2-T2V-A14B-Diffusers", "model.height=720", "model.width=1280",
            "model.num_frames=81", "parallel.sharding=fsdp2"]
    cfg = REPO / "configs" / "wan21_t2v_1.3b_dance.yaml"
    whole = plan_config(cfg, 8, overrides=base)
    assert whole.device["other_expert"] == 2 * n and whole.device["text_encoders"] == 2 * e
    sharded = plan_config(cfg, 8, overrides=[*base, "parallel.experts=shard", "parallel.text_encoders=shard"])
    assert sharded.device["other_expert"] == 2 * n / 8 and sharded.device["text_encoders"] == 2 * e / 8
    off = plan_config(cfg, 8, overrides=[*base, "parallel.experts=offload"])  # whole in each rank's host memory
    assert off.device["other_expert"] == 0 and off.host["other_expert"] == 2 * n
    # 81 frames at 720 x 1280: 21 latent frames of 45 x 80 tokens; the context degree divides the activations
    tokens = 21 * 45 * 80
    cp = plan_config(cfg, 8, overrides=[*base, "parallel.context_degree=8"])
    assert cp.activations_plain == pytest.approx(whole.activations_plain / 8)
    per_row = 40 * (79.0 * tokens + 12.0 * 512) * 5120
    assert whole.activations_plain == pytest.approx(2 * whole.workload.train_rows * per_row)  # true CFG: 2 branches


def test_wan_image_to_video_rows_count_the_released_transformers_and_encoders():
    """Wan2.1 I2V 14B: a transformer of 36 input channels with image key/value projections (image_dim 1280), UMT5-XXL
    and the CLIP ViT-H/14 vision tower as encoders; Wan2.2 I2V A14B: two 36-channel experts, no image encoder. The
    transformers are built here from the released diffusers configs (scripts/convert_wan_to_diffusers.py)."""
    from diffusers import WanTransformer3DModel
    from transformers import CLIPVisionConfig, CLIPVisionModel, UMT5Config, UMT5EncoderModel

    body = {"patch_size": (1, 2, 2), "num_attention_heads": 40, "attention_head_dim": 128, "in_channels": 36,
            "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 13824, "num_layers": 40,
            "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6}
    with torch.device("meta"):
        wan21 = WanTransformer3DModel(**body, image_dim=1280, added_kv_proj_dim=5120)
        wan22 = WanTransformer3DModel(**body)
        umt5 = UMT5EncoderModel(UMT5Config(d_model=4096, d_ff=10240, num_layers=24, num_heads=64, d_kv=64,
                                           vocab_size=256384, feed_forward_proj="gated-gelu",
                                           is_encoder_decoder=False))
        clip = CLIPVisionModel(CLIPVisionConfig(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                                                num_attention_heads=16, image_size=224, patch_size=14))
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    base = ["parallel.sharding=fsdp2", *FULL_FROM_LORA, "model.height=480", "model.width=832",
            "model.num_frames=81"]
    p21 = plan_config(REPO / "configs" / "wan21_i2v_14b.yaml", 8, overrides=base)
    assert p21.device["weights"] == 0 and p21.device["masters"] == 4 * count(wan21) / 8
    assert p21.device["text_encoders"] == 2 * (count(umt5) + count(clip))
    p22 = plan_config(REPO / "configs" / "wan22_i2v_a14b.yaml", 8, overrides=base)
    assert p22.device["other_expert"] == 2 * count(wan22) and p22.device["masters"] == 4 * count(wan22) / 8
    assert count(wan21) > count(wan22) + 2e9  # the image projections: 2 x 5120² x 40 blocks and more
    from flowgrpo.memory_plan.families import FAMILIES

    assert FAMILIES["wan21_i2v_14b"].text_tokens(512) == 512 + 257  # the CLIP image tokens join the keys


def test_every_shipped_config_is_planned_or_refused_in_one_line(capsys):
    """Every shipped config (configs/ and the embedded default) gets a plan on 1 and 8 GPUs from ``flowgrpo plan``
    (FLUX.2 [klein] was "not in the plan"), except the embedded digits and tiny models, refused in one line that
    says why."""
    from flowgrpo.cli import main
    from flowgrpo.config import load_config

    planned = refused = 0
    for path in [*sorted((REPO / "configs").glob("*.yaml")), REPO / "flowgrpo" / "tasks" / "digits" / "default.yaml"]:
        pretrained = load_config(path).model.pretrained
        for gpus in (1, 8):
            if pretrained in ("digits", "tiny"):
                with pytest.raises(SystemExit) as err:
                    main(["plan", str(path), "--gpus", str(gpus)])
                line = capsys.readouterr().err
                assert err.value.code == 2 and line.count("\n") == 1, (path.name, line)
                assert f"model.pretrained={pretrained!r} is an embedded model" in line and "no memory plan" in line
                refused += 1
                continue
            if gpus == 8:  # the command itself once, the plan's figures on 1 GPU
                main(["plan", str(path), "--gpus", str(gpus)])
                assert f"{path.name} on {gpus} GPUs" in capsys.readouterr().out, path.name
            else:
                p = plan_config(path, gpus)
                assert p.peak > 0 and math.isfinite(p.peak) and p.phases["update"] >= p.device["activations"], path
            planned += 1
    assert planned >= 2 * 26 and refused >= 2 * 16
    # docs/many_gpus.md's table of the shipped configs and its one-GPU list are the plan's (the list missed most
    # configs; the table eight), counted here on the sizes the loop above cached
    spec = importlib.util.spec_from_file_location("bench_memory_plan", REPO / "bench" / "memory_plan.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    doc = (REPO / "docs" / "many_gpus.md").read_text()
    paths = sorted((REPO / "configs").glob("*.yaml"))
    table = bench.config_table(paths)
    assert table in doc, "docs/many_gpus.md: regenerate the shipped configs' table (bench/memory.py --plan)"
    assert bench.host_table(paths) in doc, "docs/many_gpus.md: regenerate the host table (bench/memory.py --plan)"
    fit, over = bench.one_gpu(paths)
    bullet = " ".join(doc.split("\n- one GPU, as shipped")[1].split("\n\n")[0].split())
    listed_fit, listed_over = (re.findall(r"`([\w.]+\.yaml)`", part) for part in
                               re.search(r"\): fit (.*?); do not fit (.*?)\. ", bullet).groups())
    assert (listed_fit, listed_over) == (fit, over)
    assert {*fit, *over} == {p.name for p in paths if load_config(p).model.pretrained not in ("digits", "tiny")}


def test_flux2_klein_rows_count_the_released_sizes():
    """The klein rows are FLUX.2's blocks at klein's depth and width: 9.08 B and 3.88 B parameters (the "9B" and
    "4B" of the names, counted here on the meta device), Qwen3-8B / -4B encoders, true CFG for the base models only."""
    from flowgrpo.memory_plan.families import PRETRAINED, QWEN3_4B, QWEN3_8B, parameter_count

    fams = {k: FAMILIES[PRETRAINED[f"black-forest-labs/FLUX.2-klein-{k}"]] for k in ("base-9B", "9B", "base-4B", "4B")}
    assert parameter_count(fams["base-9B"].transformer) == pytest.approx(9.08e9, rel=2e-3)
    assert parameter_count(fams["4B"].transformer) == pytest.approx(3.88e9, rel=2e-3)
    assert fams["base-9B"].encoders == (QWEN3_8B,) and fams["4B"].encoders == (QWEN3_4B,)
    assert [f.true_cfg for f in fams.values()] == [True, False, True, False]
    assert fams["base-9B"].width == 4096 and sum(k.count for k in fams["9B"].kinds) == 8 + 24


@pytest.mark.parametrize(("over", "expected"), [
    # FLUX.1-dev's transformer has 24 attention heads (its released config.json): Ulysses cannot split them 5 ways
    (["--gpus", "40", "parallel.context_degree=5"],
     "--gpus 40: the run would not start: parallel.context_degree=5 with ulysses attention splits the attention "
     "heads: FLUX.1-dev has 24, not a multiple of 5"),
    # 1008 x 1040 pixels: (1008 / 16) x (1040 / 16) = 63 x 65 = 4095 image tokens, odd
    (["--gpus", "16", "parallel.context_degree=2", "model.height=1008", "model.width=1040"],
     "--gpus 16: the run would not start: parallel.context_degree=2 splits each transformer call's tokens evenly, "
     "but an image of this run has 4095 tokens (1008x1040 of FLUX.1-dev), not a multiple of 2"),
    # ring attention splits no heads, but 512 x 512 is 32 x 32 = 1024 tokens, not a multiple of 3
    (["--gpus", "24", "parallel.context_degree=3", "parallel.context_attention=ring"],
     "has 1024 tokens (512x512 of FLUX.1-dev), not a multiple of 3"),
])
def test_cli_plan_refuses_a_context_degree_the_trainer_refuses(over, expected, capsys):
    """``flowgrpo plan`` said "fits" for a context degree the trainer's preflight refuses (fresh-user trial): it
    runs the same check (:func:`flowgrpo.distributed.context_parallel.check_split`) on the planned model's heads and
    tokens."""
    from flowgrpo.cli import main

    with pytest.raises(SystemExit) as err:
        main(["plan", str(REPO / "configs" / "flux_grpo.yaml"), "parallel.sharding=fsdp2", *over])
    line = capsys.readouterr().err
    assert err.value.code == 2 and line.count("\n") == 1 and expected in line, line
    main(["plan", str(REPO / "configs" / "flux_grpo.yaml"), "parallel.sharding=fsdp2", "--gpus", "16",
          "parallel.context_degree=2"])  # 24 heads and 1024 tokens: both split in two
    assert "context 2" in capsys.readouterr().out


def test_cli_plan_prints_the_table_and_refuses_a_bad_layout(capsys):
    from flowgrpo.cli import main

    main(["plan", str(REPO / "configs" / "flux_chunk.yaml"), "--gpus", "16", "parallel.replicate=2",
          "--gpu-memory-gib", "80"])
    out = capsys.readouterr().out
    assert "16 GPUs = replicate 2 × shard 8 × context 1" in out
    assert "| optimizer (AdamW) | 11.1 | 0.0 |" in out  # 8 bytes × 11.9 B parameters / 8 ranks
    assert "activations, checkpointing on (config)" in out and "**fits**" in out
    with pytest.raises(SystemExit) as err:
        main(["plan", str(REPO / "configs" / "flux_chunk.yaml"), "--gpus", "6", "parallel.replicate=4"])
    assert err.value.code == 2
    assert "--gpus 6 is not a multiple" in capsys.readouterr().err
    # a layout the mesh takes but a batch the trainer refuses to split (it said "fits"): the trainer's own line
    with pytest.raises(SystemExit) as err:
        main(["plan", str(REPO / "configs" / "flux_chunk.yaml"), "--gpus", "7"])
    line = capsys.readouterr().err
    assert err.value.code == 2 and line.count("\n") == 1
    from flowgrpo.config import load_config

    b = load_config(REPO / "configs" / "flux_chunk.yaml").batch_size
    assert b % 7 and f"--gpus 7: the run would not start: the batch B = prompts_per_epoch*group_size = {b} " \
                      "cannot be split evenly over 7 processes" in line, line
    # without sharding there is no shard dimension: the line names none (it said "shard 8 ... no sharding")
    main(["plan", str(REPO / "configs" / "flux_chunk.yaml"), "--gpus", "8", "parallel.sharding=none",
          "--gpu-memory-gib", "141"])
    head = next(line for line in capsys.readouterr().out.splitlines() if "tokens;" in line)
    assert "8 GPUs; no sharding (DDP: every GPU holds the whole model), samples split over 8 data ranks" in head
    assert "shard" not in head.replace("no sharding", "")
    assert GIB == 2**30 and plan  # the module's public names


def test_gradient_sync_and_a_one_transformer_model():
    """FSDP2 with gradient_sync=step keeps whole float32 gradients until the step (4 bytes a parameter on every
    rank), micro_batch their shards; parallel.experts other than device is refused for a one-transformer model."""
    cfg = REPO / "configs" / "flux_chunk.yaml"
    n = sizes("flux").transformer
    assert plan_config(cfg, 8, overrides=["parallel.gradient_sync=micro_batch"]).device["grads"] == 4 * n / 8
    assert plan_config(cfg, 8, overrides=["parallel.gradient_sync=step"]).device["grads"] == 4 * n
    with pytest.raises(ValueError, match="parallel.experts=shard"):
        plan_config(cfg, 8, overrides=["parallel.experts=shard"])


def test_ltx2_and_hunyuan_video15_rows_count_the_released_models():
    """LTX-2 and HunyuanVideo-1.5 (text- and image-to-video): parts built here from the released architectures
    (their diffusers classes' defaults, which give the published 18.9 B / 8.3 B; Gemma 3 12B, Qwen2.5-VL-7B's
    language model, ByT5-small and SigLIP so400m from their configs), tokens and latents by hand from the VAEs'
    compressions, and LTX-2's four guided rows a sample (CFG pair, STG, modality isolation) in the activations."""
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        HunyuanVideo15Transformer3DModel,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors, LTX2Vocoder
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3TextConfig,
        Qwen2_5_VLTextConfig,
        Qwen2_5_VLTextModel,
        SiglipVisionConfig,
        SiglipVisionModel,
        T5Config,
        T5EncoderModel,
    )

    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    with torch.device("meta"):
        ltx = count(LTX2VideoTransformer3DModel())
        gemma = count(Gemma3ForConditionalGeneration(Gemma3Config(
            text_config=Gemma3TextConfig(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                                         num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                                         vocab_size=262208),
            vision_config=SiglipVisionConfig(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                                             num_attention_heads=16, image_size=896, patch_size=14))))
        connectors = count(LTX2TextConnectors())
        ltx_vaes = count(AutoencoderKLLTX2Video()) + count(AutoencoderKLLTX2Audio()) + count(LTX2Vocoder())
        hy = count(HunyuanVideo15Transformer3DModel())
        qwen = count(Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(hidden_size=3584, intermediate_size=18944,
                                                              num_hidden_layers=28, num_attention_heads=28,
                                                              num_key_value_heads=4, vocab_size=152064)))
        byt5 = count(T5EncoderModel(T5Config(d_model=1472, d_ff=3584, num_layers=12, num_heads=6, d_kv=64,
                                             vocab_size=384, feed_forward_proj="gated-gelu",
                                             is_encoder_decoder=False)))
        siglip = count(SiglipVisionModel(SiglipVisionConfig(hidden_size=1152, intermediate_size=4304,
                                                            num_hidden_layers=27, num_attention_heads=16,
                                                            image_size=384, patch_size=14)))
        hy_vae = count(AutoencoderKLHunyuanVideo15())
    assert 18.5e9 < ltx < 19.5e9 and 8.2e9 < hy < 8.4e9 and 12.1e9 < gemma < 12.3e9  # "19B", "8.3B", "12B"
    full = ["parallel.sharding=fsdp2", *FULL_FROM_LORA]
    p = plan_config(REPO / "configs" / "ltx2_t2v.yaml", 8, overrides=full)
    assert p.device["masters"] == 4 * ltx / 8 and p.device["text_encoders"] == 2 * (gemma + connectors)
    assert p.device["vae"] == 2 * ltx_vaes
    fam = FAMILIES["ltx2"]
    # 512 x 768 x 121: F' = 16 latent frames of 16 x 24 tokens; 126 audio latent frames of 8 x 16
    assert fam.tokens(512, 768, 121) == 16 * 16 * 24
    assert fam.latent(512, 768, 121) == 128 * 16 * 16 * 24 + 8 * 16 * 126
    w = p.workload
    one = activation_bytes(fam, fam.tokens(512, 768, 121), 1024, True)  # one row, checkpointing on (config)
    assert p.device["activations"] == pytest.approx(4 * w.train_rows * one)  # four guided rows, even at scale 1
    p_i2v = plan_config(REPO / "configs" / "hunyuan_video15_i2v.yaml", 8, overrides=full)
    assert p_i2v.device["masters"] == 4 * hy / 8 and p_i2v.device["vae"] == 2 * hy_vae
    assert p_i2v.device["text_encoders"] == 2 * (qwen + byt5 + siglip)
    t2v = plan_config(REPO / "configs" / "hunyuan_video15_i2v.yaml", 8, overrides=[
        *full, "model.pretrained=hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v"])
    assert t2v.device["text_encoders"] == 2 * (qwen + byt5)
    hfam = FAMILIES["hunyuan_video15"]
    assert hfam.tokens(480, 848, 121) == 31 * 30 * 53 and hfam.latent(480, 848, 121) == 32 * 31 * 30 * 53
    assert hfam.text_tokens(1000) == 1000 + 256 + 729


def _count(build) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in build().parameters())


def _flux_frozen_modules() -> tuple[int, int, int]:
    """(T5-XXL encoder, CLIP-L text encoder, VAE) parameters, built from FLUX.1-dev's text_encoder_2/,
    text_encoder/ and vae/ config.json."""
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    t5 = _count(lambda: T5EncoderModel(T5Config(d_model=4096, d_ff=10240, num_layers=24, num_heads=64, d_kv=64,
                                                vocab_size=32128, feed_forward_proj="gated-gelu",
                                                is_encoder_decoder=False)))
    clip = _count(lambda: CLIPTextModel(CLIPTextConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                                       num_attention_heads=12, vocab_size=49408,
                                                       max_position_embeddings=77)))
    vae = _count(lambda: AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                                       up_block_types=("UpDecoderBlock2D",) * 4,
                                       block_out_channels=(128, 256, 512, 512), layers_per_block=2,
                                       latent_channels=16, use_quant_conv=False, use_post_quant_conv=False))
    return t5, clip, vae


def test_stages_of_flux_full_fine_tuning_on_8_gpus():
    """What a rank of FLUX.1-dev full fine-tuning (bf16, FSDP2 over 8 GPUs, one float32 reward model of 1 B
    parameters, latents in host memory) holds at each stage, from parameter counts: at start-up the frozen modules
    every rank loads whole (T5-XXL ≈ 4.76 B and CLIP-L ≈ 0.12 B in bf16, the VAE, the reward model) and its own
    bf16 shard of the transformer (and of the reference copy when the objective needs one); at a save the
    steady host parts and DCP's 10 MB copy-ahead plus one tensor; at the export rank 0 holds one 10 GB file and
    the float32 tensor being gathered, the others that tensor (the export is written one file at a time). Per
    node: rank 0 and 7 others. LoRA under FSDP2: rank 0 reads the whole base; without sharding every rank does."""
    from flowgrpo.memory_plan.estimate import Workload, render

    n = _flux_dev_parameters()
    t5, clip, vae = _flux_frozen_modules()
    assert 4.7e9 < t5 < 4.8e9 and 0.12e9 < clip < 0.13e9
    with torch.device("meta"):
        from flowgrpo.memory_plan.families import _flux1

        model = _flux1()
    block = max(sum(p.numel() for p in b.parameters())
                for b in [*model.transformer_blocks, *model.single_transformer_blocks])
    reward = 10**9
    w = Workload(family="flux", finetune="full", dtype="bfloat16", height=720, width=720, frames=1,
                 max_sequence_length=512, train_rows=1, rollout_rows=1, samples=16, steps=15,
                 gradient_checkpointing=True, rewards=((reward, 4),), sharding="fsdp2", latents_on_cpu=True)
    latents = 2 * 16 * (720 // 8) ** 2 * 4 * 16  # 2 samples a rank, 16 latents each, 16 × 90 × 90 float32
    frozen = 2 * (t5 + clip + vae) + 4 * reward
    p = plan(w, 8)
    st = p.stages
    assert p.host["rollout_latents"] == latents
    assert st["start-up"].rank0 == pytest.approx(frozen + 2 * n / 8) and st["start-up"].other == st["start-up"].rank0
    assert st["start-up"].node(8) == pytest.approx(8 * (frozen + 2 * n / 8)) and p.ranks_per_node == 8
    assert st["steady state"].rank0 == pytest.approx(latents) and st["steady state"].device == p.peak
    assert st["save"].rank0 == pytest.approx(latents + 10**7 + 4 * block / 8) == st["save"].other
    # the export is written one file at a time: one 10 GB file of bf16 tensors (FLUX.1-dev's 23.8 GB is 3 files)
    # and the float32 tensor being gathered (at most a block), which every rank gathers
    assert 2 * n > 10**10
    assert st["export"].rank0 == pytest.approx(latents + 10**10 + 4 * block)
    assert st["export"].other == pytest.approx(latents + 4 * block)
    assert st["export"].node(8) == pytest.approx(8 * (latents + 4 * block) + 10**10)
    # the rendered stage table, one row per stage with the figures above in GiB
    out = render(p)
    g = lambda v: f"{v / 2**30:.1f}"  # noqa: E731
    assert (f"| start-up | {g(st['start-up'].device)} | {g(frozen + n / 4)} | {g(frozen + n / 4)} | "
            f"{g(8 * frozen + 2 * n)} |") in out
    assert (f"| export | {g(st['export'].device)} | {g(latents + 10**10 + 4 * block)} | {g(latents + 4 * block)} |"
            in out)
    assert "host, node of rank 0 (8 ranks, GiB)" in out
    # a reference copy: its shard too; 16 GPUs on nodes of 8: the node holds 8 ranks
    ref = plan(dataclasses.replace(w, reference_copy=True), 16, gpus_per_node=8)
    assert ref.stages["start-up"].rank0 == pytest.approx(frozen + 2 * (2 * n / 16))
    # LoRA under FSDP2: rank 0 reads the whole bf16 base, the others none of it; without sharding every rank
    lora = plan(dataclasses.replace(w, finetune="lora"), 8)
    assert lora.stages["start-up"].rank0 == pytest.approx(frozen + 2 * n)
    assert lora.stages["start-up"].other == pytest.approx(frozen)
    assert any("rank 0 reads the whole base transformer" in note for note in lora.notes)
    ddp = plan(dataclasses.replace(w, sharding="none"), 8)
    assert ddp.stages["start-up"].other == pytest.approx(frozen + 2 * n)
    # an unsharded save: rank 0 gathers the float32 weights, AdamW's two moments and the EMA
    ddp_ema = plan(dataclasses.replace(w, sharding="none", ema=True), 8)
    assert ddp_ema.stages["save"].rank0 == pytest.approx(latents + 4 * n * 4)
    assert ddp_ema.stages["save"].other == pytest.approx(latents)
    # a node's host memory above --host-gib is noted; 8 × start-up here is about 177 GiB
    assert not any("assumed a node" in note for note in p.notes)
    small = plan(w, 8, host_gib=100)
    assert any("at start-up (8 ranks), above the 100 GiB assumed a node" in note for note in small.notes)


def test_wan22_a14b_recipe_latents_per_rank_and_node():
    """The documented Wan2.2 A14B recipe on 8 GPUs (context degree 8, latents in host memory): one data rank, so
    every rank keeps all the epoch's samples' latents, (T + 1) × 16 × 21 × 90 × 160 float32 each: 72.7 GiB a rank,
    8 × that a node; and at start-up each rank reads only its shard of the untrained expert (``experts: shard``),
    where ``experts: device`` loads it whole on every rank."""
    from flowgrpo.config import load_config

    over = ["model.pretrained=Wan-AI/Wan2.2-T2V-A14B-Diffusers", "model.height=720", "model.width=1280",
            "model.num_frames=81", "train.rollout_batch_size=1", "train.train_batch_size=1",
            "parallel.sharding=fsdp2", "parallel.experts=shard", "parallel.text_encoders=shard",
            "train.latents_on_cpu=true", "parallel.context_degree=8"]
    cfg = REPO / "configs" / "wan21_t2v_1.3b_dance.yaml"
    c = load_config(cfg, over)
    latents = c.batch_size * (c.sampling.num_steps + 1) * 16 * 21 * 90 * 160 * 4
    assert latents / GIB == pytest.approx(72.7, abs=0.05)
    p = plan_config(cfg, 8, overrides=over)
    assert p.host["rollout_latents"] == latents
    assert p.stages["steady state"].node(8) == pytest.approx(8 * latents)
    n = sizes("wan22_a14b").transformer
    # experts: shard: every rank builds the untrained expert empty and reads its own shard, as the trained one's
    shard = p.stages["start-up"].other
    assert 2 * (2 * n / 8) <= shard < 2 * n
    whole = plan_config(cfg, 8, overrides=[*over, "parallel.experts=device"]).stages["start-up"].other
    assert whole - shard == pytest.approx(2 * n - 2 * n / 8)  # experts: device: loaded whole by every rank


#: a shipped config of each registered objective (full fine-tuning), for the test below
OBJECTIVE_CONFIGS = ("digits", "digits_awm", "digits_dgpo", "digits_dpo", "digits_dpo_offline", "digits_nft",
                     "digits_opd", "digits_refl", "digits_sft", "digits_srpo",
                     "digits_dmd2", "digits_tdm_r1")


@pytest.mark.parametrize("name", OBJECTIVE_CONFIGS)
@pytest.mark.parametrize("kl", [None, 0.0, 0.04])
def test_plan_counts_what_the_objective_keeps(name, kl):
    """Full fine-tuning of FLUX.1-dev (FSDP2, 2 GPUs) with each registered objective: the plan counts the frozen
    reference copy exactly when the objective the trainer builds says it forwards one (``needs_reference``, as
    runner.py asks it; DPO, DGPO, NFT and AWM with ``objective.kl_beta`` 0 do), the float32 old copy when it keeps one
    (``uses_old_copy``), a whole teacher when it loads one (``frozen_teacher``, OPD and DMD2) and a trained copy of it
    when it keeps one (``trains_teacher_copy``, DMD2's and TDM-R1's fake score), and TDM-R1's surrogate with its slow
    copy (``surrogate_copies``): each the objective's own answer, never a hand list (the plan read
    ``objective.kl_beta > 0`` and missed them)."""
    from flowgrpo.algo.objectives import build_objective
    from flowgrpo.config import ConfigError, load_config

    over = ["model.pretrained=black-forest-labs/FLUX.1-dev", "model.finetune=full", "model.dtype=bfloat16",
            "parallel.sharding=fsdp2"]
    path = REPO / "configs" / f"{name}.yaml"
    if kl is not None:  # the KL weight where the objective reads it
        key = "objective.kl_beta" if load_config(path).objective.name == "sde_ratio" else "objective.kl_beta"
        over.append(f"{key}={kl}")
    try:
        config = load_config(path, over)
    except ConfigError:
        pytest.skip(f"{name} has no KL weight to set")
    trainer = build_objective(config)  # what runner.py asks
    n = sizes("flux").transformer
    p = plan_config(path, 2, overrides=over)  # 2: a count every digits config's batch splits over
    assert p.device["reference"] == (2 * n / 2 if trainer.needs_reference else 0), name
    assert p.device["old_copy"] == (4 * n / 2 if getattr(trainer, "uses_old_copy", False) else 0), name
    assert p.device["teacher"] == (2 * n if getattr(trainer, "frozen_teacher", False) else 0), name
    # DMD2's fake score: a whole float32 copy, its gradients and AdamW's two moments on every rank
    assert p.device["fake_score"] == (4 * 4 * n if getattr(trainer, "trains_teacher_copy", False) else 0), name
    assert (p.device["fake_score"] > 0) == (name in ("digits_dmd2", "digits_tdm_r1"))  # the ones that keep one
    # TDM-R1's surrogate: another trained copy (16 bytes a weight) and its float32 slow copy (4)
    assert p.device["surrogate"] == ((16 + 4) * n if getattr(trainer, "surrogate_copies", False) else 0), name
    assert (p.device["surrogate"] > 0) == (name == "digits_tdm_r1")


def test_tdm_r1s_copies_under_lora_are_lora_adapters():
    """configs/sd35_tdm_r1.yaml (LoRA): TDM-R1's fake score and surrogate are LoRA adapters on the teacher (its
    ``lora_copies``), so the plan counts their LoRA weights (16 and 16 + 4 bytes a weight), not whole copies; the
    release's preset then fits an 80 GB GPU (it did not with whole copies: 153.5 GiB)."""
    p = plan_config(REPO / "configs" / "sd35_tdm_r1.yaml", 8)
    lora = sizes(p.workload.family, 32, tuple(p.workload.lora_targets)).lora
    assert p.device["fake_score"] == 16 * lora and p.device["surrogate"] == 20 * lora
    assert p.fits


def test_every_registered_objective_is_planned_above():
    """The objective test above covers every registered objective (a new one must join it)."""
    from flowgrpo.algo.objectives import OBJECTIVES
    from flowgrpo.config import load_config

    covered = {load_config(REPO / "configs" / f"{n}.yaml").objective.name for n in OBJECTIVE_CONFIGS}
    assert covered == set(OBJECTIVES)


def test_cli_plan_nodes_and_host_memory(capsys):
    """``--gpus-per-node`` sets the ranks a node's host figure sums (start-up of flux_chunk.yaml: 4 ranks of
    21.0 GiB), ``--host-gib`` the node's host memory a note compares it with; a non-positive one is refused in one
    line."""
    from flowgrpo.cli import main

    cfg = str(REPO / "configs" / "flux_chunk.yaml")
    main(["plan", cfg, "--gpus", "16", "parallel.replicate=2", "--gpus-per-node", "4", "--host-gib", "50"])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| start-up |")).split(" | ")
    assert "host, node of rank 0 (4 ranks, GiB)" in out and float(row[4].strip(" |")) == pytest.approx(
        4 * float(row[2]), abs=0.3)  # 4 × a rounded figure
    assert "Note: the node of rank 0 holds" in out and "above the 50 GiB assumed a node (--host-gib)" in out
    with pytest.raises(SystemExit) as err:
        main(["plan", cfg, "--gpus", "8", "--host-gib", "0"])
    assert err.value.code == 2 and "argument --host-gib: 0.0 is out of range" in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--gpu-memory-gib", "--host-gib"])
@pytest.mark.parametrize("value", ["nan", "inf", "-5", "0"])
def test_plan_refuses_a_memory_that_is_not_a_positive_number(option, value, capsys):
    """``--gpu-memory-gib nan`` printed "Peak 48.5 GiB of nan usable: does NOT fit" and exited 0 (a fresh user's
    trial); every such value is argparse's one-line usage error naming the option."""
    from flowgrpo.cli import main

    with pytest.raises(SystemExit) as err:
        main(["plan", str(REPO / "configs" / "flux_grpo.yaml"), "--gpus", "8", option, value])
    assert err.value.code == 2 and option in capsys.readouterr().err


def test_rollout_workers_hold_the_whole_policy_unsharded(capsys):
    """runtime.engine=ray: each rollout worker holds the whole policy on a GPU of its own, whatever the training
    mesh: flux_chunk.yaml (FLUX.1-dev full fine-tuning, bfloat16) keeps float32 masters (4 bytes a parameter, the
    trainer's, to sample bit for bit as it would) and autocast's bfloat16 copy during a forward (2 bytes), and no
    gradient, AdamW moment or reference; flux_grpo.yaml's LoRA keeps the bfloat16 base (2 bytes) and its float32
    adapter. A torchrun plan has no worker."""
    from flowgrpo.cli import main

    n = _flux_dev_parameters()
    cfg = REPO / "configs" / "flux_chunk.yaml"
    assert plan_config(cfg, 8).worker == {}
    ray = ["runtime.engine=ray", "runtime.rollout_workers=2"]
    p8, p16 = plan_config(cfg, 8, overrides=ray), plan_config(cfg, 16, overrides=[*ray, "parallel.replicate=2"])
    w = p8.worker
    assert (w["masters"], w["transient"], w["weights"]) == (4 * n, 2 * n, 0)
    assert "grads" not in w and "optimizer" not in w and "reference" not in w
    assert p16.worker["masters"] == w["masters"]  # not divided by the mesh (the training GPUs' shards are)
    assert p8.device["masters"] == 4 * n / 8
    assert w["text_encoders"] == sizes("flux").encoders * 2  # T5-XXL and CLIP-L whole in bfloat16
    # one request: one data rank's share of the epoch's samples, (T + 1) float32 latents each, as a training GPU's
    assert w["rollout_latents"] == p8.device["rollout_latents"]
    held = w["masters"] + w["text_encoders"] + w["vae"] + w["rollout_latents"]
    assert p8.worker_peak == pytest.approx(held + max(w["sampling"] + 2 * n, w["decode"]))
    assert p8.worker_peak > 6 * n  # above the 71 GB of FLUX.1-dev's masters and their copy: no 80 GiB GPU holds it
    assert not p8.fits and p8.peak <= p8.budget  # the training GPUs fit, the workers do not
    lora = plan_config(REPO / "configs" / "flux_grpo.yaml", 8, overrides=ray).worker
    assert lora["weights"] == 2 * n and lora["transient"] == 0
    assert lora["masters"] == 4 * _lora_of("flux_grpo.yaml")
    main(["plan", str(cfg), "--gpus", "8", *ray])
    out = capsys.readouterr().out
    assert "Rollout workers (runtime.engine=ray): 2 Ray actors" in out and "(10 in all;" in out
    assert f"| trained weights, float32 (LoRA: the adapter; full: the masters) | {4 * n / GIB:.1f} |" in out
    assert "Peak " in out and "**fits**" in out  # the training GPUs' verdict
    assert re.search(r"Rollout worker peak [\d.]+ GiB of 76.0 usable: \*\*does NOT fit", out), out


def _lora_of(config: str) -> int:
    """The LoRA parameters of ``config`` counted on the meta-device FLUX.1-dev with peft (rank and targets)."""
    from peft import LoraConfig

    from flowgrpo.config import load_config

    m = load_config(REPO / "configs" / config).model
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        tr = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
                                    attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                                    pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
        tr.add_adapter(LoraConfig(r=m.lora_rank, lora_alpha=m.lora_alpha, target_modules=list(m.lora_target_modules)))
    return sum(p.numel() for name, p in tr.named_parameters() if "lora_" in name)
