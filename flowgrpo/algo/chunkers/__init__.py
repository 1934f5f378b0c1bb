"""Chunkers: which transitions are stochastic, which are trained, and which share one importance ratio.

One strategy per module, each registered in :data:`CHUNKERS` with its settings model:

=================  ==========================================================================  ======================
name               what it does                                                                module
=================  ==========================================================================  ======================
``per_step``       every transition its own ratio (Flow-GRPO, DanceGRPO)                       :mod:`.per_step`
``chunk``          contiguous chunks share one ratio (Chunk-GRPO / GCPO)                       :mod:`.chunk`
``trajectory``     one ratio for the whole trajectory (GSPO-style)                             :mod:`.trajectory`
``window``         SDE only inside a sliding window (MixGRPO)                                  :mod:`.window`
``entropy_merge``  entropy-merged jumps, shared-anchor branching (E-GRPO)                      :mod:`.entropy_merge`
=================  ==========================================================================  ======================

A new strategy is a subclass of :class:`BaseChunker` with a ``Config`` (subclass of :class:`ChunkerConfig`)
registered with ``@CHUNKERS.register(name)``, from any module imported before the config is built.
"""

from flowgrpo.algo.chunkers.base import (
    CHUNKERS,
    BaseChunker,
    Chunker,
    ChunkerConfig,
    DropLastConfig,
    build_chunker,
    chunker_config_class,
    chunker_settings,
    fraction_count,
    make_plan,
    release_count,
    trainable_steps,
)
from flowgrpo.algo.chunkers.chunk import Chunk, ChunkConfig, adaptive_chunks, chunk_weights, relative_l1
from flowgrpo.algo.chunkers.entropy_merge import (
    EntropyMerge,
    EntropyMergeConfig,
    jump_entropy,
    merge_plan,
    step_entropies,
)
from flowgrpo.algo.chunkers.per_step import PerStep, PerStepConfig
from flowgrpo.algo.chunkers.trajectory import TrajectoryConfig, WholeTrajectory
from flowgrpo.algo.chunkers.window import SlidingWindow, WindowConfig

__all__ = [
    "CHUNKERS", "BaseChunker", "Chunker", "ChunkerConfig", "DropLastConfig", "build_chunker",
    "chunker_config_class", "chunker_settings", "fraction_count", "make_plan", "release_count", "trainable_steps",
    "Chunk", "ChunkConfig", "adaptive_chunks", "chunk_weights", "relative_l1",
    "EntropyMerge", "EntropyMergeConfig", "jump_entropy", "merge_plan", "step_entropies",
    "PerStep", "PerStepConfig", "TrajectoryConfig", "WholeTrajectory", "SlidingWindow", "WindowConfig",
]
