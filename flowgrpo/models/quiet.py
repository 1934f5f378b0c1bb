"""The libraries' console output kept to their errors while flowgrpo runs (:func:`quiet_libraries`)."""

from __future__ import annotations

import logging
import os
import warnings

LIBRARY_PROGRESS_ENV = "FLOWGRPO_LIBRARY_PROGRESS"


def quiet_libraries() -> None:
    """Keep the console for our metrics: silence the libraries' per-call notices (truncated prompts,
    deprecations), their progress bars (weight loading, downloads; shown again with ``FLOWGRPO_LIBRARY_PROGRESS=1``)
    and httpx's line per HTTP request of a remote reward (shown when the root logger is at DEBUG), not their
    errors."""
    import diffusers  # heavy: imported only when the command runs
    import transformers

    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.set_verbosity_error()
    if os.environ.get(LIBRARY_PROGRESS_ENV, "0") != "1":
        diffusers.utils.logging.disable_progress_bar()
        transformers.utils.logging.disable_progress_bar()
        try:
            from huggingface_hub.utils import disable_progress_bars
        except ImportError:  # pragma: no cover - huggingface_hub comes with diffusers
            pass
        else:
            disable_progress_bars()
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        for name in ("httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning, module="diffusers")
