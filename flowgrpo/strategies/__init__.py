"""The base under every config section and strategy: the name → strategy registry (:mod:`.registry`) and the
settings base every config section and strategy's settings model derive from (:mod:`.settings`). It imports
nothing else of flowgrpo, so :mod:`flowgrpo.config` and :mod:`flowgrpo.algo` both build on it without a circle."""
