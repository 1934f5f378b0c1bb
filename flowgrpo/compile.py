"""Regional compilation of the transformer (``model.compile``): diffusers' ``ModelMixin.compile_repeated_blocks``.

With ``model.compile: {name: regional}`` each repeated block of the transformer (the classes its
``_repeated_blocks`` names: FLUX.1's ``FluxTransformerBlock`` and ``FluxSingleTransformerBlock``) is compiled in
place (``torch.nn.Module.compile``, so the module, its parameters, LoRA layers and state-dict names stay what they
were). The compile happens once, in :func:`flowgrpo.parallel.prepare_model`, on the module the rollout and the
update both call: they share one compiled forward path (the frozen reference, when one is kept, is compiled the
same way). With ``parallel.sharding=fsdp2`` the blocks are compiled before ``fully_shard`` (the order torchtitan
uses: "per-TransformerBlock compile after AC wrapping and before FSDP"; after ``fully_shard`` the blocks' classes
are renamed ``FSDP<name>`` and diffusers' lookup by class name would find none).

Exactness contract (docs/design.md, "Exactness"): the compiled kernels round differently from eager ones (fused
operations), so compiled and eager velocities agree to float32 rounding, not bit for bit. Inside a compiled run the
rollout runs the no-grad (inference) graph and the update the training graph; they are separate compilations, so
the first update's ``policy/logprob_mismatch_max`` is reported as without compile (0 when the two graphs round
alike, as on the CPU measured, about float32 rounding otherwise). In recompute mode
(``objective.recompute_old_log_probs`` or a chunker that needs it) the old log-probs are recomputed by the training
graph itself (:func:`training_graph`: gradient recording on, outputs detached, train mode), so the first ratio is
exactly 1 and the mismatch exactly 0.

Shapes: ``dynamic: null`` (torch's default, automatic dynamic) compiles the first shapes statically and, on the
first change of a dimension (a batch size, a resolution), recompiles once with that dimension symbolic; ``true``
compiles symbolic shapes from the start; ``false`` specialises every shape (a recompile per new shape, up to
torch's ``recompile_limit``, after which dynamo runs the block eagerly). :class:`CompileWatch` reports the graphs
compiled and the compile seconds per epoch (``compile/graphs``, ``compile/seconds``, from torch._dynamo's
counters) and warns once when an epoch after the first compiles again.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

logger = logging.getLogger(__name__)


def compile_regions(module: torch.nn.Module, settings) -> int:
    """Compile every repeated block of ``module`` in place with ``settings`` (a
    :class:`~flowgrpo.config.CompileConfig`, name ``regional``) through diffusers' ``compile_repeated_blocks``.
    Returns the number of blocks compiled.

    Raises:
        ValueError: a ``mode`` other than ``default`` with a backend other than inductor (it would be ignored);
            ``module`` is not a diffusers model with ``_repeated_blocks`` (one line naming its class), or is
            already sharded (its blocks would not be found by class name).
    """
    from diffusers.models.modeling_utils import ModelMixin

    if settings.backend != "inductor" and settings.mode != "default":
        raise ValueError(f"model.compile.mode={settings.mode!r} is inductor's; backend {settings.backend!r} has no "
                         "modes: set mode to default or backend to inductor")
    name = type(module).__name__
    if not isinstance(module, ModelMixin) or not getattr(module, "_repeated_blocks", None):
        raise ValueError(f"model.compile=regional: {name} names no repeated blocks (diffusers' _repeated_blocks); "
                         "set model.compile to none")
    if name.startswith("FSDP"):
        raise ValueError(f"model.compile=regional: {name} is already sharded; compile before fully_shard")
    kwargs = {"backend": settings.backend, "dynamic": settings.dynamic, "fullgraph": settings.fullgraph}
    if settings.backend == "inductor" and settings.mode != "default":
        kwargs["mode"] = settings.mode
    module.compile_repeated_blocks(**kwargs)
    blocks = sum(1 for m in module.modules() if type(m).__name__ in module._repeated_blocks)
    module._flowgrpo_compiled = True
    logger.info("model.compile=regional: %d blocks of %s compiled (backend %s, dynamic %s, fullgraph %s); the "
                "first calls of each shape and mode compile their graphs", blocks, name, settings.backend,
                settings.dynamic, settings.fullgraph)
    return blocks


def is_compiled(adapter) -> bool:
    """Whether the adapter's transformer was compiled by :func:`compile_regions`."""
    return bool(getattr(getattr(adapter, "transformer", None), "_flowgrpo_compiled", False))


@contextlib.contextmanager
def training_graph(adapter) -> Iterator[None]:
    """The block runs the forward the update runs: with a compiled transformer, gradient recording on and the
    transformer in train mode (the training graph; outputs must be detached by the caller), else plain no-grad
    (eager kernels are the same with and without gradient recording)."""
    if not is_compiled(adapter):
        with torch.no_grad():
            yield
        return
    module = adapter.transformer  # the blocks' mode (forward_module may be a wrapper: DDP, FSDP, ComputeIn)
    if not module.training:
        module.train()
    with torch.enable_grad():
        yield


#: torch._dynamo's compile timers summed into ``compile/seconds``: the forward compile (dynamo's trace and the
#: backend's forward graph) and AOTAutograd's backward graph, which is compiled lazily, at the first backward of
#: each training graph, outside the first timer (torch 2.14 ``_functorch/_aot_autograd/runtime_wrappers.py``)
COMPILE_TIMERS = ("_compile.compile_inner", "backward._backward_impl")


def _dynamo_totals() -> tuple[int, float]:
    """(graphs compiled, seconds spent compiling forward and backward graphs: :data:`COMPILE_TIMERS`) by
    torch._dynamo in this process so far."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    graphs = int(counters["stats"]["unique_graphs"])
    seconds = float(sum(sum(compilation_time_metrics.get(k, [])) for k in COMPILE_TIMERS))
    return graphs, seconds


class CompileWatch:
    """Per-epoch compile figures of a compiled run: ``compile/graphs`` (graphs compiled during the epoch),
    ``compile/seconds`` (dynamo + backend time of those compiles, the lazily compiled backward graphs included:
    :data:`COMPILE_TIMERS`) and ``compile/graphs_total``. The first epoch's compile is logged in one line; an epoch
    after the first that compiles again (a new batch size, resolution, train/eval mode or guard) is warned about
    once, with its count; later ones are only counted."""

    def __init__(self, dynamic) -> None:
        self.dynamic = dynamic
        self.graphs, self.seconds = _dynamo_totals()
        self.epochs = 0
        self.warned = False

    def epoch_metrics(self, epoch: int) -> dict[str, float]:
        """The figures of the epoch just ended (0-based ``epoch``, shown 1-based); logs as described above."""
        graphs, seconds = _dynamo_totals()
        new, secs = graphs - self.graphs, seconds - self.seconds
        self.graphs, self.seconds = graphs, seconds
        self.epochs += 1
        if self.epochs == 1:
            logger.info("model.compile: %d graph(s) compiled in %.1f s in epoch %d", new, secs, epoch + 1)
        elif new and not self.warned:
            self.warned = True
            logger.warning("model.compile: epoch %d compiled %d more graph(s) (%.1f s; %d in all): a new shape "
                           "(batch size, resolution), train/eval mode or guard; dynamic=%s. Later compiles are "
                           "counted in compile/graphs without a warning", epoch + 1, new, secs, graphs, self.dynamic)
        return {"compile/graphs": float(new), "compile/seconds": secs, "compile/graphs_total": float(graphs)}
