"""What sits on each device, and which engines launch a run: the rule of ``flowgrpo.parallel`` checked without a
GPU (the meta device stands in for one: moving a module there is observable, and nothing is computed on it).

* ``parallel.text_encoders: offload`` leaves the text encoders in host memory and moves them to the device only
  while prompts are encoded (``adapter.pipe.to(device)`` used to put T5-XXL's 9.5 GB on every GPU);
* under ``parallel.sharding: fsdp2`` the transformer stays in host memory until each block is sharded onto the
  device (so no process ever holds the whole transformer on its device);
* accelerate's FSDP plugin and DeepSpeed engine are refused with one line naming what to use; no shipped
  accelerate config selects them.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from flowgrpo import parallel
from flowgrpo.config import ParallelConfig

REPO = Path(__file__).resolve().parents[1]
META = torch.device("meta")


def _devices(module: torch.nn.Module) -> set[str]:
    return {p.device.type for p in module.parameters()}


@pytest.fixture
def adapter(tiny_flux_dir):
    from flowgrpo.models import load_model

    return load_model(str(tiny_flux_dir), max_sequence_length=16, height=32, width=32)


def test_offloaded_text_encoders_stay_in_host_memory(adapter):
    parallel.place_pipeline(adapter, META, ParallelConfig(text_encoders="offload"))
    pipe = adapter.pipe
    assert _devices(pipe.transformer) == _devices(pipe.vae) == {"meta"}
    assert _devices(pipe.text_encoder) == _devices(pipe.text_encoder_2) == {"cpu"}
    assert adapter.encoders_offload is not None and set(map(id, adapter.encoders_offload.modules)) == {
        id(pipe.text_encoder), id(pipe.text_encoder_2)}


def test_a_sharded_transformer_waits_in_host_memory(adapter):
    parallel.place_pipeline(adapter, META, ParallelConfig(sharding="fsdp2"))
    pipe = adapter.pipe
    assert _devices(pipe.transformer) == {"cpu"}
    assert _devices(pipe.vae) == _devices(pipe.text_encoder) == _devices(pipe.text_encoder_2) == {"meta"}
    assert adapter.encoders_offload is None


def test_by_default_every_part_is_on_the_device(adapter):
    parallel.place_pipeline(adapter, META, ParallelConfig())
    for name, part in adapter.pipe.components.items():
        if isinstance(part, torch.nn.Module):
            assert _devices(part) == {"meta"}, name


class _Spy(torch.nn.Module):
    """Records where it is moved (``to``), and moves nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.moves: list[str] = []

    def to(self, device):
        self.moves.append(str(device))
        return self


def test_offloaded_encoders_are_on_the_device_only_while_encoding(adapter):
    from flowgrpo.sampling.rollout import encode_rows

    spies = [_Spy(), _Spy()]
    adapter.encoders_offload = parallel.EncoderOffload(spies, META)
    seen = []
    adapter.encode_prompts = lambda prompts: seen.append([s.moves[-1] for s in spies]) or _embeds(prompts)
    encode_rows(adapter, ["a", "b", "a"])
    assert seen == [["meta", "meta"]]  # on the device while encoding
    assert [s.moves for s in spies] == [["meta", "cpu"], ["meta", "cpu"]]  # and back in host memory after


def _embeds(prompts):
    from flowgrpo.records import PromptEmbeds

    return PromptEmbeds({"prompt_embeds": torch.zeros(len(prompts), 2, 4)}, {})


@pytest.mark.parametrize("kind", ["DEEPSPEED", "FSDP", "MEGATRON_LM"])
def test_accelerates_own_engines_are_refused_with_what_to_use(kind):
    from accelerate.utils import DistributedType

    acc = SimpleNamespace(distributed_type=getattr(DistributedType, kind), mixed_precision="no")
    with pytest.raises(ValueError, match="parallel.sharding=fsdp2") as err:
        parallel.check_engine(acc, ParallelConfig())
    assert "\n" not in str(err.value)  # one line


def test_accelerate_mixed_precision_is_refused_under_fsdp2():
    from accelerate.utils import DistributedType

    acc = SimpleNamespace(distributed_type=DistributedType.MULTI_GPU, mixed_precision="bf16")
    parallel.check_engine(acc, ParallelConfig())  # DDP: accelerate's autocast is as before
    with pytest.raises(ValueError, match="model.dtype"):
        parallel.check_engine(acc, ParallelConfig(sharding="fsdp2"))


def test_shipped_accelerate_configs_are_plain_launches():
    """The sharding is flowgrpo's: no shipped launch config selects accelerate's FSDP or DeepSpeed, or lists
    block classes by hand (the old fsdp.yaml named FLUX's and SD3's blocks, which no single model has)."""
    files = sorted((REPO / "configs" / "accelerate").glob("*.yaml"))
    assert {f.name for f in files} >= {"default.yaml", "multi_gpu.yaml", "multi_node.yaml", "fsdp.yaml"}
    for f in files:
        cfg = yaml.safe_load(f.read_text())
        assert cfg["distributed_type"] in ("NO", "MULTI_GPU", "MULTI_CPU"), f.name
        assert not {k for k in cfg if k.startswith(("fsdp", "deepspeed"))}, f.name
        assert cfg.get("mixed_precision", "no") == "no", f.name


def test_the_wrap_rule_is_the_models_own_list():
    """The blocks come from the model's ``_no_split_modules`` (or a list the adapter gives); a list naming
    classes the model lacks is refused by name."""
    from diffusers import FluxTransformer2DModel

    tr = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=1,
                                attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                pooled_projection_dim=16, axes_dims_rope=(2, 2, 4))
    blocks = parallel.shard_blocks(tr)
    assert [type(b).__name__ for b in blocks] == ["FluxTransformerBlock"] * 2 + ["FluxSingleTransformerBlock"]
    with pytest.raises(ValueError, match="JointTransformerBlock"):
        parallel.shard_blocks(tr, ["JointTransformerBlock"])
