"""Where the rollout runs: the training processes themselves (``runtime.engine: torchrun``, the default) or Ray
rollout workers (``runtime.engine: ray``, :mod:`flowgrpo.runtime.ray_engine`); docs/async.md."""
