"""``model.compile: regional`` (flowgrpo.compile): diffusers' compile_repeated_blocks on the tiny FLUX with LoRA.

One test (inductor compiles take tens of seconds on a CPU): the compiled SDE rollout's log-probs and the compiled
training forward's LoRA gradients agree with eager ones to float32 rounding (the kernels differ, so not bit for
bit), and through the real trainer, recompute mode under compile gives a first-update log-prob mismatch of exactly
0.0 (the old log-probs come from the update's own training graph). Heavier checks (FSDP2, shape changes, speed):
``bench/speed.py --parts g``.
"""

from __future__ import annotations

import pytest
import torch

from flowgrpo.config import CompileConfig, build_config
from flowgrpo.writing.metrics import read_metrics

#: float32 rounding of a few fused layers: eps32 = 1.19e-7 times the accumulated operations' condition; the
#: velocities here are O(1), so a relative 1e-5 allows ~100 ulps and fails on any wrong computation (a missing
#: LoRA, a stale weight: differences of order 1e-2 and more)
ROUNDING = 1e-5


def _rollout_and_grads(adapter, embeds, x0):
    from flowgrpo.config import SamplingConfig
    from flowgrpo.sampling.rollout import denoise

    settings = SamplingConfig(num_steps=3, guidance_scale=3.5)
    sigmas = adapter.sigmas(3)
    gens = [torch.Generator().manual_seed(10 + i) for i in range(x0.shape[0])]
    with torch.no_grad():
        _, log_probs, _ = denoise(adapter, x0, embeds, sigmas, settings, torch.ones(3, dtype=torch.bool), gens)
    adapter.transformer.zero_grad(set_to_none=True)
    v = adapter.velocity(x0, sigmas[1].expand(x0.shape[0]), embeds, 3.5)
    (v * torch.linspace(-1, 1, v.numel()).view_as(v)).sum().backward()
    grads = {n: p.grad.clone() for n, p in adapter.transformer.named_parameters() if p.requires_grad}
    return log_probs, v.detach(), grads


def test_compile_seconds_count_the_lazily_compiled_backward_graphs(monkeypatch):
    """AOTAutograd compiles a training graph's backward at its first backward, timed under its own key
    (``backward._backward_impl``), not inside dynamo's forward compile (``_compile.compile_inner``): an epoch's
    ``compile/seconds`` is the sum of both timers' new entries (here 1.5 + 2.25 s, written into torch's own table)."""
    from torch._dynamo import utils

    from flowgrpo.compile import CompileWatch

    table = {k: list(v) for k, v in utils.compilation_time_metrics.items()}
    monkeypatch.setattr(utils, "compilation_time_metrics", table)
    watch = CompileWatch(None)
    table.setdefault("_compile.compile_inner", []).append(1.5)
    table.setdefault("backward._backward_impl", []).append(2.25)
    table.setdefault("some_other_timer", []).append(100.0)  # a timer nested in the two: not counted again
    assert watch.epoch_metrics(0)["compile/seconds"] == 3.75
    assert watch.epoch_metrics(1)["compile/seconds"] == 0.0


def test_an_inductor_mode_with_another_backend_is_refused_not_ignored():
    """``mode`` is passed to torch.compile only with inductor; with aot_eager or eager a non-default mode would be
    dropped without a word, so it is refused in one line naming both settings (before any module is looked at)."""
    from flowgrpo.compile import compile_regions

    for backend in ("aot_eager", "eager"):
        settings = CompileConfig(name="regional", backend=backend, mode="max-autotune-no-cudagraphs")
        with pytest.raises(ValueError, match=rf"^model.compile.mode='max-autotune-no-cudagraphs' is inductor's; "
                                             rf"backend '{backend}' has no modes"):
            compile_regions(torch.nn.Linear(1, 1), settings)
    with pytest.raises(ValueError, match="Linear names no repeated blocks"):  # the next check: the module's
        compile_regions(torch.nn.Linear(1, 1), CompileConfig(name="regional", backend="aot_eager"))


@pytest.mark.slow
def test_regional_compile_matches_eager_and_recompute_is_exact(tmp_path, tiny_flux_dir):
    from flowgrpo.compile import compile_regions, is_compiled
    from flowgrpo.models import load_model
    from flowgrpo.models.lora import setup_trainable
    from flowgrpo.runner import run
    from flowgrpo.sampling.rollout import encode_rows

    torch.manual_seed(0)
    adapter = load_model(str(tiny_flux_dir), max_sequence_length=16, height=32, width=32)
    setup_trainable(adapter, finetune="lora", rank=8, alpha=16.0, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                    need_reference=False)
    for p in adapter.transformer.parameters():  # LoRA B starts at 0: give it a value so the LoRA path counts
        if p.requires_grad:
            p.data.normal_(0, 0.05)
    embeds = encode_rows(adapter, ["a red cube", "a red cube", "a blue ball", "a blue ball"])
    x0 = adapter.initial_latents(4, [torch.Generator().manual_seed(i) for i in range(4)])
    lp_e, v_e, g_e = _rollout_and_grads(adapter, embeds, x0)
    assert compile_regions(adapter.transformer, CompileConfig(name="regional")) == 2  # a double and a single block
    assert is_compiled(adapter)
    lp_c, v_c, g_c = _rollout_and_grads(adapter, embeds, x0)
    assert torch.isfinite(lp_e).all()
    torch.testing.assert_close(lp_c, lp_e, rtol=ROUNDING, atol=ROUNDING)
    torch.testing.assert_close(v_c, v_e, rtol=ROUNDING, atol=ROUNDING * float(v_e.abs().max()))
    assert g_c.keys() == g_e.keys() and len(g_e) > 0
    for name, g in g_e.items():
        torch.testing.assert_close(g_c[name], g, rtol=ROUNDING, atol=ROUNDING * float(g.abs().max()), msg=name)

    # the real trainer, compiled, in recompute mode: the first ratio is exactly 1
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red cube\na blue ball\n")
    cfg = build_config({
        "output_dir": str(tmp_path / "run"),
        "model": {"pretrained": str(tiny_flux_dir), "max_sequence_length": 16, "height": 32, "width": 32,
                  "compile": {"name": "regional"}},
        "sampling": {"num_steps": 3},
        "train": {"num_epochs": 1, "prompts_per_epoch": 2, "group_size": 2, "rollout_batch_size": 4,
                  "train_batch_size": 4, "lr": 1e-2},
        "algo": {"recompute_old_log_probs": True},
        "rewards": [{"name": "jpeg_incompressibility"}],
        "data": {"train_prompts": str(prompts)},
        "logging": {"progress": False},
    })
    run(cfg)
    rec = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    assert rec["policy/logprob_mismatch_max"] == 0.0
    assert rec["policy/ratio_mean"] == 1.0
    assert rec["compile/graphs_total"] >= 1 and "compile/seconds" in rec
