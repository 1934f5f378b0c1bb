"""Context parallelism on every model family of the zoo: two processes split one transformer call's tokens (a table;
never a test).

    torchrun --nproc_per_node 2 bench/context_families.py [--attention ulysses|ring] [--families flux,wan21,...]
             [--json PATH]

(on the CPU: ``OMP_NUM_THREADS=1 torchrun ...``; gloo.) Each process builds (rank 0; the other waits) and loads the
family's tiny random pipeline of the conformance suite (``flowgrpo.models.random_pipelines.CASES``), computes the
velocity of
two rows at σ = 0.95 and the gradients of ``mean(v²)`` with the whole transformer, then applies what a run with
``parallel.sharding: fsdp2, context_degree: 2`` applies (``flowgrpo.distributed.context_parallel.check_context``,
``enable_context``
on the mesh's ``context`` dimension, ``shard`` over the flattened (shard, context) ranks) and computes them again
(the loss scaled by the world size: FSDP2 averages the ranks' gradients, whose sum is the whole gradient). Per
family: the transformer's tokens (image, text), max |Δv| / max |v|, the largest gradient gap relative to that
gradient's scale, or the one-line refusal (a family without a ``_cp_plan``, a token count 2 does not divide) or
the error raised.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as torch_dist  # noqa: E402

from flowgrpo import parallel  # noqa: E402
from flowgrpo.checkpoints.state_dicts import full_tensor  # noqa: E402
from flowgrpo.config import ParallelConfig  # noqa: E402
from flowgrpo.distributed import context_parallel, dist
from flowgrpo.models import load_model  # noqa: E402
from flowgrpo.models.random_pipelines import CASES  # noqa: E402
from flowgrpo.rng import make_generator  # noqa: E402
from flowgrpo.sampling.rollout import encode_rows  # noqa: E402

CPU = torch.device("cpu")


def _sources(case, folder: Path) -> list[dict]:
    """Two rows' metadata: a source image each for an editing family, else empty."""
    if case.condition is None:
        return [{}, {}]
    from PIL import Image

    from flowgrpo.testing.rewards import default_images

    out = []
    for i, img in enumerate(default_images(2, case.size, case.size, torch.Generator().manual_seed(0))):
        path = folder / f"source{i}.png"
        if dist.rank() == 0:
            Image.fromarray((img.permute(1, 2, 0) * 255).round().byte().numpy()).save(path)
        out.append({"images": [str(path)]})
    dist.barrier()
    return out


def _tokens(tr, shapes: dict) -> dict:
    """The transformer call's token counts, from the first call's input shapes."""
    return {k: context_parallel._tokens(tr, torch.empty(s, device="meta")) for k, s in shapes.items()}


def one_family(name: str, root: Path, attention: str) -> dict:
    """One family's row, with the case's module constants scaled to its tiny model (LTX-2's STG block)."""
    with CASES[name].patched() as case:
        return _one_family(case, root, attention)


def _one_family(case, root: Path, attention: str) -> dict:
    name = case.name
    folder = root / name
    if dist.rank() == 0:
        case.build(folder / "pipeline")
    dist.barrier()
    adapter = load_model(str(folder / "pipeline"), height=case.size, width=case.size,
                         max_sequence_length=case.max_sequence_length, **case.load_kwargs)
    tr = adapter.transformer
    x = adapter.initial_latents(2, [make_generator(0, "x", i) for i in range(2)])
    embeds = encode_rows(adapter, list(case.prompts), _sources(case, folder))
    shapes: dict = {}

    def record(module, args, kwargs):
        for key in ("hidden_states", "encoder_hidden_states"):
            if not shapes.get(key) and isinstance(kwargs.get(key), torch.Tensor):
                shapes[key] = tuple(kwargs[key].shape)

    handle = tr.register_forward_pre_hook(record, with_kwargs=True)

    def velocity_and_gradients(scale: float):
        tr.zero_grad(set_to_none=True)
        v = adapter.velocity(x, torch.full((2,), 0.95), embeds, case.guidance_scale)
        (v.square().mean() * scale).backward()
        return v.detach(), {n: full_tensor(p.grad) for n, p in tr.named_parameters() if p.grad is not None}

    v_whole, g_whole = velocity_and_gradients(1.0)
    handle.remove()
    row = {"family": name, "transformer": type(tr).__name__, "tokens": _tokens(tr, shapes)}
    settings = ParallelConfig(sharding="fsdp2", context_degree=dist.world_size(), context_attention=attention)
    try:
        context_parallel.check_context(adapter, settings, CPU)
        mesh = parallel.device_mesh(CPU, settings)
        dist.set_context_degree(settings.context_degree)
        context_parallel.enable_context(context_parallel.context_modules(adapter), mesh, settings, CPU)
        parallel.shard(tr, mesh=parallel.fsdp_mesh(mesh), param_dtype=None, reshard=True,
                       names=getattr(adapter, "shard_blocks", None))
        v_split, g_split = velocity_and_gradients(float(dist.world_size()))
    except Exception as err:  # noqa: BLE001 - a bench row reports whatever stops a family
        return {**row, "result": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
    finally:
        dist.set_context_degree(1)
    gap = max(float((g_whole[n] - g_split[n]).abs().max() / g_whole[n].abs().max().clamp(min=1e-30))
              for n in g_whole)
    assert g_whole.keys() == g_split.keys(), name
    return {**row, "result": "split", "velocity_gap": float((v_whole - v_split).abs().max() / v_whole.abs().max()),
            "gradient_gap": gap, "gradients": len(g_whole)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attention", choices=("ulysses", "ring"), default="ulysses")
    parser.add_argument("--families", default=",".join(CASES))
    parser.add_argument("--json", help="write the rows here (rank 0)")
    args = parser.parse_args()
    torch_dist.init_process_group("gloo")
    torch.manual_seed(0)
    from flowgrpo.models.quiet import quiet_libraries

    quiet_libraries()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if dist.world_size() > 1:  # one folder for both ranks: rank 0's name
            names = [str(root)]
            torch_dist.broadcast_object_list(names, src=0)
            root = Path(names[0])
        for name in args.families.split(","):
            rows.append(one_family(name, root, args.attention))
            if dist.rank() == 0:
                print(json.dumps(rows[-1]), flush=True)  # noqa: T201 - the bench's table
        dist.barrier()
    if dist.rank() == 0 and args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    dist.end_worker()


if __name__ == "__main__":
    main()
