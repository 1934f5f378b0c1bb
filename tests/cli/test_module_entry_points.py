"""``python -m flowgrpo.<module>``: every module with a ``__main__`` block runs without runpy's RuntimeWarning
"found in sys.modules after import of package …, but prior to execution" (printed when the package's
``__init__`` has already imported the module, which then runs twice: ``python -m flowgrpo.models.tiny`` did)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "flowgrpo"


def _runnable() -> list[str]:
    """The dotted names of the package's modules that have a ``if __name__ == "__main__":`` block."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if 'if __name__ == "__main__":' in path.read_text():
            found.append(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
    return found


def test_no_runnable_module_is_imported_by_its_package():
    names = _runnable()
    assert "flowgrpo.models.tiny" in names and "flowgrpo.tasks.digits.model" in names
    # runpy imports the parent package first, then warns if the module is already there: the same check, each
    # module in a fresh interpreter
    check = ("import importlib, sys\n"
             "for name in sys.argv[1:]:\n"
             "    for k in [k for k in sys.modules if k.startswith('flowgrpo')]:\n"
             "        del sys.modules[k]\n"
             "    importlib.import_module(name.rpartition('.')[0])\n"
             "    if name in sys.modules:\n"
             "        print(name)\n")
    out = subprocess.run([sys.executable, "-c", check, *names], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [], out.stdout


def test_python_m_tiny_prints_no_runtime_warning(tmp_path):
    out = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", "flowgrpo.models.tiny",
                          str(tmp_path / "tiny")], capture_output=True, text=True)
    assert out.returncode == 0 and "RuntimeWarning" not in out.stderr, out.stderr[-2000:]
    assert (tmp_path / "tiny" / "model_index.json").is_file()
