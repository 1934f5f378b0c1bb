"""The training script: ``accelerate launch -q flowgrpo/train.py [CONFIG.yaml] [dotted.key=value ...]``.

``python flowgrpo/train.py [CONFIG.yaml] --help`` lists every config field with the value the run would use. The
command itself is :func:`flowgrpo.runner.main`; :func:`flowgrpo.runner.run` trains from a config in Python.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable, drop flowgrpo/ from the path
    _here = Path(__file__).resolve().parent
    sys.path = [p for p in sys.path if Path(p or ".").resolve() != _here]
    sys.path.insert(0, str(_here.parent))

from flowgrpo.runner import main  # noqa: E402 - after the path set-up

if __name__ == "__main__":
    main()
