"""Every module of the package imports, under whichever torch runs the tests: CI runs this file under the newest
torch and, in `.venv-oldest` (`scripts/setup_venv.py --oldest-torch`), under the oldest that pyproject.toml allows."""

import subprocess
import sys
from pathlib import Path

import naflexclip

PACKAGE = Path(naflexclip.__file__).parent


def test_every_module_imports_in_a_fresh_interpreter():
    modules = sorted(".".join(("naflexclip", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(
        ".__init__") for path in PACKAGE.rglob("*.py") if path.stem != "__main__")
    assert "naflexclip.train" in modules and "naflexclip.checkpoints.sharded" in modules
    code = ("import importlib, sys, traceback\nfailed = 0\n"
            f"for name in {modules!r}:\n"
            "    try:\n        importlib.import_module(name)\n"
            "    except Exception:\n        failed += 1\n"
            "        print(name, traceback.format_exc().splitlines()[-1])\n"
            "sys.exit(failed)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
