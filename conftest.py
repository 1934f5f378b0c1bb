"""Settings of the whole test session (tests/ and rewards/tests/), applied before any test module imports a library.

The suite never reaches the network: ``huggingface_hub`` reads ``HF_HUB_OFFLINE`` once, when it is first imported, so
a test module that sets it itself is too late whenever an earlier module imported the hub already — and each lookup
then waits for the hub's connection timeouts and retries (minutes on a machine whose network drops packets).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
