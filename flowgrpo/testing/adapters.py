"""A conformance test class for model adapters: every adapter runs it, so every model is verified the same way.

A new adapter adds one :class:`~flowgrpo.models.random_pipelines.ConformanceCase` to
``flowgrpo.models.random_pipelines.CASES`` (how to
build its tiny random pipeline folder and how to call its pipeline) and one line in
``tests/models/test_conformance.py``::

    class TestMyModel(AdapterConformance): case = CASES["my_model"]

Each ``test_*`` method checks one clause of the adapter contract (``docs/new_model.md``) against diffusers itself,
never against a snapshot of the adapter's own output:

* the folder's ``model_index.json`` class selects the adapter (registry lookup, ``from_pretrained`` load);
* **parity**: the ODE rollout (our σ grid, initial noise, velocity and Euler step) reproduces every step's
  latents and the decoded images of ``Pipeline.__call__`` with the same prompts, generators, steps, guidance
  and size, to ``case.parity_atol`` (1e-6 unless a case documents why not);
* the SDE rollout at noise level 0 is the ODE rollout, bit for bit;
* **on-policy exactness**: re-scoring a rollout's transitions with the trainer's own training forward gives
  the rollout's log-probs bit for bit (importance ratio exactly 1);
* **LoRA**: a LoRA saved by :func:`flowgrpo.models.lora.save_lora` and loaded by the pipeline's own
  ``load_lora_weights`` gives the same images as the adapter, to 1e-5, and the LoRA matters;
* **sharding**: the blocks FSDP2 shards are found in the model by its own list (``_no_split_modules``, or the
  adapter's ``shard_blocks``); sharded (a one-process group), the transformer gives the velocity of the whole one
  bit for bit, and its gradients to 1e-5 (a weight several blocks read sums their terms in another order);
* **start-up of a sharded run**: with ``empty_transformer`` the trained transformer is built on the meta device
  (no weights read) with the loaded one's parameter names and shapes and its buffers;
* **training**: one epoch through the real trainer (``flowgrpo.runner.run``) with the ``per_step`` and ``chunk``
  strategies, with a log-prob mismatch of exactly 0.0 at the first update; for a case with ``forward_objective``
  also one epoch of DiffusionNFT (a forward-process objective), whose trained and old-copy velocities agree
  exactly at the epoch's one update (``objective/old_deviation`` 0.0).

Video models (a case with ``num_frames``) run the same clauses: latents (B, C, F', h, w), decoded videos
(B, F, 3, H, W) compared with the pipeline's ``frames``, and training with an image reward over every frame
(``video_frames``).

Needs pytest (``pip install "flowgrpo[test]"``).
"""

from __future__ import annotations

import contextlib
import inspect
import json
from pathlib import Path

import torch

try:
    import pytest
except ImportError as err:  # pragma: no cover - the class is only useful under pytest
    raise ImportError('flowgrpo.testing.adapters needs pytest: pip install "flowgrpo[test]"') from err

from flowgrpo.config import SamplingConfig, build_config
from flowgrpo.models import ADAPTERS, load_model, pipeline_class_name
from flowgrpo.models.base import decode_latents
from flowgrpo.models.lora import load_lora_into, save_lora, setup_trainable
from flowgrpo.models.random_pipelines import ConformanceCase
from flowgrpo.runner import run
from flowgrpo.sampling.packed_forward import chunk_forward
from flowgrpo.sampling.rollout import RolloutRequest, denoise, encode_rows, load_condition_images, rollout
from flowgrpo.testing.rewards import default_images

_BUILT: dict[tuple[str, str], Path] = {}


def tiny_folder(case: ConformanceCase, tmp_path_factory) -> Path:
    """The case's tiny pipeline folder, built once per test session (other tests reuse the suite's build)."""
    key = (str(tmp_path_factory.getbasetemp()), case.name)
    if key not in _BUILT:
        _BUILT[key] = Path(case.build(tmp_path_factory.mktemp(f"tiny_{case.name}") / "pipeline"))
    return _BUILT[key]


@contextlib.contextmanager
def _step_outputs(pipe, record: list):
    """Yield ``"callback"`` when ``pipe.__call__`` takes ``callback_on_step_end`` (the suite records each step's
    latents with it); else yield None and record the output of each ``scheduler.step`` call instead (a pipeline
    without step callbacks, e.g. diffusers 0.42's ``HunyuanVideo15Pipeline``)."""
    if "callback_on_step_end" in inspect.signature(pipe.__call__).parameters:
        yield "callback"
        return
    step = pipe.scheduler.step

    def recording(*args, **kwargs):
        out = step(*args, **kwargs)
        record.append((out[0] if isinstance(out, tuple) else out.prev_sample).clone())
        return out

    pipe.scheduler.step = recording
    try:
        yield None
    finally:
        del pipe.scheduler.step  # back to the class's method


def _is_modular(pipe) -> bool:
    from diffusers import ModularPipeline

    return isinstance(pipe, ModularPipeline)


def _generators(seeds) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(int(s)) for s in seeds]


class AdapterConformance:
    """Subclass with ``case = <ConformanceCase>`` (the subclass name must start with ``Test``)."""

    case: ConformanceCase

    # ------------------------------------------------------------------ fixtures
    @pytest.fixture(scope="class", autouse=True)
    def _one_thread(self):
        """Tiny models gain nothing from intra-op threads, and lose much on a busy machine."""
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        yield
        torch.set_num_threads(before)

    @pytest.fixture(scope="class", autouse=True)
    def _module_patches(self):
        """The case's ``module_patches`` (pipeline-module constants such as a conditioning image area) for the
        class's duration, seen alike by the pipeline and the adapter."""
        import importlib

        with pytest.MonkeyPatch.context() as mp:
            for target, value in self.case.module_patches.items():
                module, attr = target.split(":")
                mp.setattr(importlib.import_module(module), attr, value)
            yield

    @pytest.fixture(scope="class")
    def folder(self, tmp_path_factory) -> Path:
        return tiny_folder(self.case, tmp_path_factory)

    def load(self, folder: Path):
        c = self.case
        return load_model(str(folder), height=c.size, width=c.size, max_sequence_length=c.max_sequence_length,
                          **c.load_kwargs)

    @pytest.fixture(scope="class")
    def adapter(self, folder):
        """Shared by the read-only tests; a test that adds LoRA or trains loads its own copy."""
        return self.load(folder)

    @pytest.fixture(scope="class")
    def sources(self, tmp_path_factory) -> list[Path] | None:
        """For an editing model: two different source images (PNG files of the output size), else None."""
        if self.case.condition is None:
            return None
        from PIL import Image

        folder = tmp_path_factory.mktemp(f"sources_{self.case.name}")
        pixels = default_images(2, self.case.size, self.case.size, torch.Generator().manual_seed(0))
        paths = []
        for i, img in enumerate(pixels):
            paths.append(folder / f"source{i}.png")
            Image.fromarray((img.permute(1, 2, 0) * 255).round().byte().numpy()).save(paths[-1])
        return paths

    @staticmethod
    def metadata(sources, n: int = 2) -> list[dict]:
        """n metadata dicts: row i conditioned on source i mod 2 (editing models), else empty."""
        return [{} if sources is None else {"images": [str(sources[i % len(sources)])]} for i in range(n)]

    def call_pipeline(self, pipe, prompts, seeds, sources, *, guidance: float, steps: int | None = None):
        """``Pipeline.__call__`` → (images (B, 3, H, W) in [0, 1], the latents after every step)."""
        c = self.case
        conditions = None
        if sources is not None:
            conditions = [load_condition_images(m["images"]) for m in self.metadata(sources, len(prompts))]
        n = c.pipeline_batch_size or len(prompts)
        images, per_step = [], []
        for start in range(0, len(prompts), n):  # pipelines that take one prompt per call are called per prompt
            sl = slice(start, start + n)
            extra = {} if conditions is None else c.condition(conditions[sl])
            steps_here = []

            def keep(_pipe, i, t, kwargs, steps_here=steps_here):
                state = kwargs["latents"] if c.callback_state is None else c.callback_state(kwargs)
                steps_here.append(state.clone())
                return {}

            if c.pipeline_setup is not None:
                c.pipeline_setup(pipe, guidance)
            modular = _is_modular(pipe)
            # a modular pipeline whose blocks take one prompt per call gets it as a string; it returns its state's
            # "images" output (there is no __call__ output class)
            prompt = prompts[sl][0] if modular and n == 1 else list(prompts[sl])
            with torch.no_grad(), _step_outputs(pipe, steps_here) as callback:
                out = pipe(prompt=prompt, generator=_generators(seeds[sl]),
                           num_inference_steps=steps or c.num_steps, output_type="pt",
                           **({"height": c.size, "width": c.size} if c.call_takes_size else {}),
                           **({} if callback is None else {"callback_on_step_end": keep}),
                           **({"output": "images"} if modular else {}), **c.call_kwargs(guidance), **extra)
            got = out if modular else out.frames if c.num_frames else out.images  # videos: (B, F, 3, H, W)
            images.append(got if c.pipeline_images is None else c.pipeline_images(got))
            per_step.append(steps_here)
        return torch.cat(images), [torch.cat(step) for step in zip(*per_step, strict=True)]

    def ode(self, adapter, prompts, seeds, sources, *, guidance: float, kind: str = "ode",
            noise_level: float = 0.0):
        """Our sampler from the adapter's noise: (latents (B, T+1, …), images)."""
        t = self.case.num_steps
        x0 = adapter.initial_latents(len(prompts), _generators(seeds))
        settings = SamplingConfig(num_steps=t, guidance_scale=guidance, sde_kind=kind, noise_level=noise_level)
        with torch.no_grad():
            embeds = encode_rows(adapter, list(prompts), self.metadata(sources, len(prompts)))
            xs, _, _ = denoise(adapter, x0, embeds, adapter.sigmas(t), settings,
                               torch.ones(t, dtype=torch.bool), _generators([s + 100 for s in seeds]))
            images = decode_latents(adapter, xs[:, -1], embeds)
        return xs, images

    # ------------------------------------------------------------------ clauses
    def test_registered_by_pipeline_class(self, folder, adapter):
        name = pipeline_class_name(str(folder))
        assert name in ADAPTERS.names()
        assert type(adapter.pipe).__name__ == name
        assert adapter.height == adapter.width == self.case.size

    def test_ode_rollout_equals_pipeline_call(self, adapter, sources):
        c = self.case
        seeds = [3, 11]
        # the pipeline's batch layout (a pipeline that takes one prompt per call is compared prompt by prompt:
        # another layout changes float32 reduction order, measured 8e-7 for Qwen-Image-Edit-Plus in a batch of 2)
        n = c.pipeline_batch_size or len(c.prompts)
        parts = [self.ode(adapter, c.prompts[i : i + n], seeds[i : i + n],
                          None if sources is None else sources[i : i + n], guidance=c.guidance_scale)
                 for i in range(0, len(c.prompts), n)]
        xs, images = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        ref_images, ref_steps = self.call_pipeline(adapter.pipe, c.prompts, seeds, sources,
                                                   guidance=c.guidance_scale)
        assert torch.equal(adapter.sigmas(c.num_steps), adapter.pipe.scheduler.sigmas.float())
        assert len(ref_steps) == c.num_steps
        for t, ref in enumerate(ref_steps):  # every step of the trajectory, not only the end
            torch.testing.assert_close(xs[:, t + 1], ref.float().reshape(xs[:, t + 1].shape), rtol=0,
                                       atol=c.parity_atol, msg=lambda m, t=t: f"step {t}: {m}")
        frames = (c.num_frames,) if c.num_frames else ()  # a video model decodes (B, F, 3, H, W)
        assert images.shape == ref_images.shape == (2, *frames, 3, c.size, c.size)
        torch.testing.assert_close(images, ref_images.float(), rtol=0, atol=c.parity_atol)
        # the comparison has power: the steps move the latents and the prompts and seeds differ
        assert float((xs[:, -1] - xs[:, 0]).abs().max()) > 1e3 * c.parity_atol
        assert float((images[0] - images[1]).abs().max()) > 1e3 * c.parity_atol

    def test_guidance_changes_the_velocity(self, adapter, sources):
        c = self.case
        if not c.guided:
            pytest.skip(f"{c.name} samples without guidance")
        x = adapter.initial_latents(2, _generators([5, 6]))
        embeds = encode_rows(adapter, list(c.prompts), self.metadata(sources))
        with torch.no_grad():
            v1 = adapter.velocity(x, torch.full((2,), 0.7), embeds, 1.0)
            v2 = adapter.velocity(x, torch.full((2,), 0.7), embeds, c.guidance_scale)
        assert v1.dtype == torch.float32 and v1.shape == x.shape
        assert float((v1 - v2).abs().max()) > 1e-4

    def test_sde_at_noise_zero_equals_ode(self, adapter, sources):
        c = self.case
        ode, _ = self.ode(adapter, c.prompts, [1, 2], sources, guidance=c.guidance_scale)
        for kind in ("flow_sde", "dance_sde"):  # (cps at a = 0 is the ODE up to rounding: another formula)
            sde, _ = self.ode(adapter, c.prompts, [1, 2], sources, guidance=c.guidance_scale, kind=kind,
                              noise_level=0.0)
            assert torch.equal(sde, ode), kind

    def test_on_policy_log_probs_are_exact(self, adapter, sources):
        c = self.case
        settings = SamplingConfig(num_steps=c.num_steps, guidance_scale=c.guidance_scale, sde_kind="flow_sde",
                                   noise_level=0.7)
        prompts = [c.prompts[0]] * 2 + [c.prompts[1]] * 2
        meta = [m for m in self.metadata(sources) for _ in range(2)]
        request = RolloutRequest(prompts=prompts, metadata=meta, prompt_ids=torch.tensor([0, 0, 1, 1]),
                                 sample_index=torch.tensor([0, 1, 0, 1]), settings=settings, batch_size=2, seed=0,
                                 epoch=0)
        traj = rollout(adapter, request, torch.ones(c.num_steps, dtype=torch.bool))
        assert torch.isfinite(traj.log_probs).all() and traj.stochastic.all()
        for rows in (torch.arange(0, 2), torch.arange(2, 4)):  # the rollout's micro-batches
            for t in range(c.num_steps):
                with torch.no_grad():
                    lp = chunk_forward(adapter, traj, rows, (t,), settings, with_ref=False).log_probs
                assert torch.equal(lp[:, 0], traj.log_probs[rows, t]), (rows.tolist(), t)

    def test_lora_round_trip_through_the_pipeline_loader(self, folder, sources, tmp_path):
        c = self.case
        adapter = self.load(folder)
        params = setup_trainable(adapter, finetune="lora", rank=4, alpha=8.0,
                                 target_modules=list(c.lora_target_modules), need_reference=False)
        assert params
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():  # lora_B starts at 0 (an identity adapter): give it values that change the model
            for name, p in adapter.transformer.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.3 * torch.randn(p.shape, generator=g))
        seeds = [21, 22]
        _, ours = self.ode(adapter, c.prompts, seeds, sources, guidance=c.guidance_scale)
        with adapter.reference():
            _, ours_base = self.ode(adapter, c.prompts, seeds, sources, guidance=c.guidance_scale)
        save_lora(adapter, tmp_path / "lora")
        fresh = (c.load_pipeline or type(adapter.pipe).from_pretrained)(str(folder))
        fresh.set_progress_bar_config(disable=True)
        base, _ = self.call_pipeline(fresh, c.prompts, seeds, sources, guidance=c.guidance_scale)
        load_lora_into(fresh, tmp_path / "lora")  # the pipeline's load_lora_weights (or its transformer's loader)
        theirs, _ = self.call_pipeline(fresh, c.prompts, seeds, sources, guidance=c.guidance_scale)
        torch.testing.assert_close(ours, theirs.float(), rtol=0, atol=1e-5)
        assert float((theirs - base).abs().max()) > 1e-3  # the LoRA matters: a lost or mis-scaled one fails above
        torch.testing.assert_close(ours_base, base.float(), rtol=0, atol=1e-5)  # reference = the base model

    def test_fsdp2_shards_the_models_blocks_and_computes_the_same(self, folder, sources):
        from torch.distributed.tensor import DTensor

        from flowgrpo import parallel
        from flowgrpo.checkpoints.state_dicts import full_tensor
        from flowgrpo.distributed import dist
        from flowgrpo.sampling.rollout import encode_rows

        c = self.case
        adapter = self.load(folder)
        tr, own = adapter.transformer, getattr(adapter, "shard_blocks", None)
        blocks = parallel.shard_blocks(tr, own)
        assert blocks and {type(b).__name__ for b in blocks} <= set(own or tr._no_split_modules)
        x = adapter.initial_latents(2, _generators([5, 6]))
        embeds = encode_rows(adapter, list(c.prompts), self.metadata(sources))

        def velocity_and_gradients():
            tr.zero_grad(set_to_none=True)
            # σ 0.95: the high-noise side, where a two-expert model (Wan2.2) runs its trained expert
            v = adapter.velocity(x, torch.full((2,), 0.95), embeds, c.guidance_scale)
            v.square().mean().backward()
            return v.detach(), {n: None if p.grad is None else full_tensor(p.grad) for n, p in tr.named_parameters()}

        v_whole, g_whole = velocity_and_gradients()
        cpu = torch.device("cpu")
        made = not dist.is_distributed()
        dist.ensure_process_group(cpu)
        try:
            parallel.shard(tr, mesh=parallel.fsdp_mesh(parallel.device_mesh(cpu)), param_dtype=None, reshard=True,
                           names=own)
            assert all(isinstance(p, DTensor) for p in tr.parameters())
            v_shard, g_shard = velocity_and_gradients()
        finally:
            if made:
                dist.release_own_group()
        assert torch.equal(v_whole, v_shard)
        assert g_whole.keys() == g_shard.keys() and sum(g is not None for g in g_whole.values()) > len(g_whole) // 2
        for n, g in g_whole.items():  # a weight used by several blocks sums their terms in another order
            assert (g is None) == (g_shard[n] is None), n
            if g is not None:
                gap = float((g - g_shard[n]).abs().max() / g.abs().max().clamp(min=1e-30))
                assert gap < 1e-5, (n, gap)

    def test_an_empty_transformer_is_the_loaded_ones_structure(self, folder, adapter):
        """``empty_transformer`` (a sharded run's processes other than the main one): the trained transformer is
        built from its config with its parameters on the meta device, the names and shapes of the loaded one's,
        and its buffers (the rotary tables some models compute) real and equal; the rest of the pipeline loads."""
        c = self.case
        empty = load_model(str(folder), height=c.size, width=c.size, max_sequence_length=c.max_sequence_length,
                           empty_transformer=True, **c.load_kwargs)
        loaded = {n: p.shape for n, p in adapter.transformer.named_parameters()}
        assert {n: p.shape for n, p in empty.transformer.named_parameters()} == loaded
        assert all(p.is_meta for p in empty.transformer.parameters())
        buffers = dict(adapter.transformer.named_buffers())
        for n, b in empty.transformer.named_buffers():
            assert not b.is_meta and torch.equal(b.to(buffers[n].dtype), buffers[n]), n
        assert not any(p.is_meta for p in empty.pipe.vae.parameters())

    def run_one_epoch(self, folder, sources, tmp_path, overrides: list[str]) -> list[dict]:
        """One epoch through the real trainer on the case's two prompts (2 samples each), with ``overrides``
        (the objective's or chunker's settings); returns ``metrics.jsonl``'s records and checks the LoRA was
        written."""
        c = self.case
        prompt_file = tmp_path / "prompts.jsonl"
        records = [{"prompt": p} for p in c.prompts]
        if sources is not None:  # editing: paths relative to the prompt file, as users write them
            (tmp_path / "img").mkdir()
            for i, (r, src) in enumerate(zip(records, sources, strict=False)):
                (tmp_path / "img" / f"s{i}.png").write_bytes(src.read_bytes())
                r["image"] = f"img/s{i}.png"
        prompt_file.write_text("".join(json.dumps(r) + "\n" for r in records))
        out = tmp_path / "run"
        cfg = build_config({}, [
            f"model.pretrained={folder}", f"model.max_sequence_length={c.max_sequence_length}",
            f"model.height={c.size}", f"model.width={c.size}", "model.lora_rank=4", "model.lora_alpha=8",
            f"model.lora_target_modules={json.dumps(list(c.lora_target_modules))}",
            f"sampling.num_steps={c.num_steps}", f"sampling.guidance_scale={c.guidance_scale}",
            "train.num_epochs=1", "train.group_size=2", "train.prompts_per_epoch=2",
            "train.rollout_batch_size=2", "train.lr=1e-3", f"data.train_prompts={prompt_file}", f"output_dir={out}",
            "logging.progress=false",
            # the evaluations before and after: 2 images in T steps (what this test checks is the training epoch)
            "data.eval_num_prompts=2", f"eval_sampling.num_steps={c.num_steps}",
            # a video model: its frame count, and the image reward scored on every frame (the video contract)
            *([f"model.num_frames={c.num_frames}",
               "rewards=[{name: video_frames, kwargs: {base: jpeg_compressibility}}]"] if c.num_frames
              else ["rewards=[{name: jpeg_compressibility}]"]),
            *overrides,
        ])
        run(cfg)
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["epoch"] for r in records] == [0]
        assert (out / "lora" / "pytorch_lora_weights.safetensors").is_file()
        return records

    @pytest.mark.parametrize("strategy", ["per_step", "chunk"])
    def test_one_epoch_of_training(self, folder, sources, tmp_path, strategy):
        c = self.case
        chunk = f"{{name: chunk, chunk_sizes: [1, {c.num_steps - 1}]}}"
        chunker = "{name: per_step}" if strategy == "per_step" else chunk
        records = self.run_one_epoch(folder, sources, tmp_path, [f"objective.chunker={chunker}"])
        assert records[0]["policy/logprob_mismatch_max"] == 0.0
        assert records[0]["adv/abs_mean"] > 0  # the update had a signal

    def test_one_epoch_of_a_forward_process_objective(self, folder, sources, tmp_path):
        """DiffusionNFT (the forward-process family): at the epoch's one optimizer step the trained weights are
        the old copy's, so the trained velocity equals the old copy's bit for bit at every training σ (the
        forward-process analogue of a log-prob mismatch of 0). Runs for the cases with ``forward_objective``."""
        if not self.case.forward_objective:
            pytest.skip(f"{self.case.name}: the forward-process epoch is run for the cases that ask for it")
        records = self.run_one_epoch(folder, sources, tmp_path, ["objective={name: nft, kl_beta: 0.0}",
                                                                 "train.optimizer_steps_per_epoch=1"])
        assert records[0]["objective/rows"] > 0
        assert records[0]["objective/old_deviation"] == 0.0
        assert records[0]["policy/grad_norm"] > 0  # the update had a signal
