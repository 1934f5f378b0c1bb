"""Diffusers modular pipelines (flowgrpo.models.modular) and the families of late 2026 (FLUX.3, its distilled flow
map, Qwen-Image 2.1) beyond the shared conformance suite: adapter selection by the modular index, FLUX.3's per-row
text windows, the distilled flow map's σ grid, context parallelism refused where diffusers has no split plan, and
``flowgrpo sample`` writing images for each. The tiny folders are the conformance suite's (built once a session).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from flowgrpo.models import load_model, pipeline_class_name
from flowgrpo.models.random_pipelines import CASES
from flowgrpo.testing.adapters import tiny_folder
from tests.tiny_runs import _one_thread  # noqa: F401 - autouse here


def _load(name: str, tmp_path_factory):
    c = CASES[name]
    return load_model(str(tiny_folder(c, tmp_path_factory)), height=c.size, width=c.size,
                      max_sequence_length=c.max_sequence_length)


def test_a_modular_folder_is_read_by_its_modular_index(tmp_path):
    modular = tmp_path / "modular"
    modular.mkdir()
    (modular / "modular_model_index.json").write_text(json.dumps({"_class_name": "Flux3ModularPipeline"}))
    assert pipeline_class_name(str(modular)) == "Flux3ModularPipeline"
    both = tmp_path / "both"  # a repository with both indexes is read as its regular pipeline
    both.mkdir()
    (both / "modular_model_index.json").write_text(json.dumps({"_class_name": "QwenImage21ModularPipeline"}))
    (both / "model_index.json").write_text(json.dumps({"_class_name": "QwenImage21Pipeline"}))
    assert pipeline_class_name(str(both)) == "QwenImage21Pipeline"
    with pytest.raises(ValueError, match="neither model_index.json nor modular_model_index.json"):
        pipeline_class_name(str(tmp_path))


def test_an_unknown_block_is_named_with_the_pipeline_class():
    """``ModularAdapter.block`` reads a copy of the block tree held for the adapter; its error names the pipeline's
    class and the names available where the path fails (not the holder's class)."""
    from flowgrpo.models.modular import ModularAdapter

    class Flux3ModularPipeline:  # the shape find_block reads: blocks with sub_blocks
        blocks = SimpleNamespace(sub_blocks={"denoise": SimpleNamespace(sub_blocks={"text2image": object()})})

    adapter = ModularAdapter.__new__(ModularAdapter)
    adapter.pipe = Flux3ModularPipeline()
    assert adapter.block("denoise.text2image") is Flux3ModularPipeline.blocks.sub_blocks["denoise"].sub_blocks[
        "text2image"]
    with pytest.raises(ValueError, match=r"^Flux3ModularPipeline has no block 'denoise.image2image': "
                                         r"'image2image' is not one of \['text2image'\]$"):
        adapter.block("denoise.image2image")


def test_flux3_rows_keep_their_own_text_windows(tmp_path_factory):
    """FLUX.3's text windows are multiples of 80 tokens the transformer attends to in full (no mask): a batch of a
    long and a short prompt gives each row the velocity it has alone (to float rounding: the batch's transformer
    calls hold other rows), not the one of a window padded to the batch's longest, and the batch's embeddings record
    each row's window (160 and 80 tokens here)."""
    adapter = _load("flux3", tmp_path_factory)
    long = " ".join(["red cube blue table"] * 25)  # ~100 tokens of the toy vocabulary: a window of 160
    prompts = [long, "two green dogs"]
    embeds = adapter.encode_prompts(prompts)
    assert embeds["text_len"].tolist() == [160, 80]
    assert embeds["prompt_embeds"].shape[1] == 160
    x = adapter.initial_latents(2, [torch.Generator().manual_seed(s) for s in (1, 2)])
    with torch.no_grad():
        both = adapter.velocity(x, torch.full((2,), 0.8), embeds, 1.0)
        for i, p in enumerate(prompts):
            alone = adapter.velocity(x[i : i + 1], torch.full((1,), 0.8), adapter.encode_prompts([p]), 1.0)
            torch.testing.assert_close(both[i : i + 1], alone, rtol=0, atol=1e-6, msg=p[:20])
        padded = adapter.velocity(x[1:], torch.full((1,), 0.8), type(embeds)(
            {"prompt_embeds": embeds["prompt_embeds"][1:], "text_len": torch.tensor([160])}, embeds.shared), 1.0)
    assert float((padded - both[1:]).abs().max()) > 1e-3  # the short row's padding would matter


def test_the_flow_map_target_below_every_grid_sigma_is_zero():
    """At σ = 0 no grid σ' is below σ: the target is 0 (argmax over an all-False row would pick the grid's first
    entry, 1, a jump back up); at a grid σ the next one, between two the lower, below the last positive one 0."""
    from flowgrpo.models.flux3 import Flux3Adapter

    adapter = Flux3Adapter.__new__(Flux3Adapter)
    adapter._grid = torch.tensor([1.0, 0.75, 0.5, 0.0])
    got = adapter._target(torch.tensor([1.0, 0.8, 0.75, 0.3, 0.0]))
    assert got.tolist() == [0.75, 0.75, 0.5, 0.0, 0.0]
    # the loop passes next_t / 1000 with next_t = σ'·1000 the scheduler's float32 timestep: for this σ' the float32
    # round trip lands one ulp above it (0x1.607b82p-2, written out by hand), and the target is that value
    odd = float.fromhex("0x1.607b80p-2")
    adapter._grid = torch.tensor([1.0, odd, 0.0])
    assert adapter._target(torch.tensor([0.5])).item() == float.fromhex("0x1.607b82p-2")


def test_the_distilled_flow_map_jumps_to_the_next_step_of_its_one_grid(tmp_path_factory):
    """The distilled transformer is called with the σ it jumps to: the next σ of the sampling grid at a grid σ, the
    largest grid σ below it elsewhere (checked against the transformer called directly); a second grid is refused."""
    adapter = _load("flux3_distilled", tmp_path_factory)
    grid = adapter.sigmas(3)
    embeds = adapter.encode_prompts(["two green dogs"])
    x = adapter.initial_latents(1, [torch.Generator().manual_seed(4)])
    tr, n = adapter.transformer, embeds["text_len"].item()
    txt_ids = torch.cartesian_prod(*(torch.arange(k) for k in (1, 1, 1, n))).float()  # (t, h, w, l): l runs
    ids = {"img_ids": adapter.img_ids, "txt_ids": txt_ids}
    for sigma, target in ((grid[1], grid[2]), (torch.tensor(0.85), grid[2]), (torch.tensor(0.5), torch.tensor(0.0))):
        with torch.no_grad():
            ours = adapter.velocity(x, sigma.expand(1), embeds, 1.0)
            direct = tr(hidden_states=x, timestep=sigma.reshape(1), target_timestep=target.reshape(1),
                        encoder_hidden_states=embeds["prompt_embeds"][:, :n], return_dict=False, **ids)[0]
        assert torch.equal(ours, direct), (float(sigma), float(target))
    with pytest.raises(ValueError, match="one σ grid per run"):
        adapter.sigmas(4)


@pytest.mark.parametrize("name", ["flux3", "qwenimage21"])
def test_context_parallelism_is_refused_without_a_split_plan(name, tmp_path_factory):
    """diffusers 0.42.1 declares no ``_cp_plan`` for the FLUX.3 and Qwen-Image 2.1 transformers: a context-parallel
    run is refused in one line, not run unsplit."""
    from flowgrpo.distributed.context_parallel import check_context

    adapter = _load(name, tmp_path_factory)
    assert getattr(adapter.transformer, "_cp_plan", None) is None
    with pytest.raises(ValueError, match="declares no _cp_plan"):
        check_context(adapter, SimpleNamespace(context_degree=2, context_kind="ulysses"), torch.device("cpu"))


@pytest.mark.parametrize("name", ["flux3", "flux3_distilled", "qwenimage21"])
def test_flowgrpo_sample_writes_images(name, tmp_path, tmp_path_factory):
    from flowgrpo.cli import main as cli_main

    c = CASES[name]
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(c.prompts) + "\n")
    out = tmp_path / "out"
    cli_main(["sample", "--model", str(tiny_folder(c, tmp_path_factory)), "--prompts", str(prompts),
              "--num-steps", "2", "--guidance-scale", str(c.guidance_scale), "--height", str(c.size), "--width",
              str(c.size), "--max-sequence-length", str(c.max_sequence_length), "--out", str(out)])
    images = torch.load(out / "images.pt")
    assert images.shape == (2, 3, c.size, c.size) and images.min() >= 0 and images.max() <= 1
    assert float((images[0] - images[1]).abs().max()) > 1e-3
    assert len(list(out.glob("*.png"))) >= 2
