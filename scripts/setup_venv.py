"""Set up `.venv` in the repository with naflexclip installed (editable) and the extras named, then exit.

    python3 scripts/setup_venv.py                   # the package: what the demo needs
    python3 scripts/setup_venv.py test benchmark    # and the extras the test suite needs

The README's two commands both start here. Run one after the other, the second installs only what the first did
not (nothing at all when its extras are already installed from the same pyproject.toml). Run at once, the second
waits for the first: one lock file serialises the venv's creation and every pip run in it, so two pip processes
never write the same site-packages. Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import venv
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
LOCK = ROOT / ".venv.lock"
STAMP = VENV / "naflexclip-install.json"  # what this script last installed, and from which pyproject.toml


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if missing) until the block ends; waits for another holder."""
    with open(path, "a+b") as handle:
        if os.name == "nt":
            import msvcrt

            handle.seek(0)
            while True:
                try:
                    msvcrt.locking(handle.fileno(), msvcrt.LK_LOCK, 1)
                    break
                except OSError:  # LK_LOCK gives up after 10 s: keep waiting
                    continue
            try:
                yield
            finally:
                handle.seek(0)
                msvcrt.locking(handle.fileno(), msvcrt.LK_UNLCK, 1)
        else:
            import fcntl

            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def venv_python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def installed() -> tuple[str, set[str]]:
    """The pyproject.toml hash and the extras of the last install here ("" and none if there was none)."""
    try:
        stamp = json.loads(STAMP.read_text())
        return str(stamp["pyproject"]), set(stamp["extras"])
    except (OSError, ValueError, KeyError, TypeError):
        return "", set()


def main(extras: list[str]) -> int:
    with locked(LOCK):
        if not venv_python().exists():
            print(f"creating {VENV.name}/", flush=True)
            venv.create(VENV, with_pip=True)
        pyproject = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
        done_for, done_extras = installed()
        wanted = set(extras) | (done_extras if done_for == pyproject else set())
        if done_for == pyproject and wanted <= done_extras:
            print(f"{VENV.name}/ is up to date (naflexclip{_extras(wanted)})", flush=True)
            return 0
        target = f".{_extras(wanted)}"
        print(f"installing naflexclip{_extras(wanted)} into {VENV.name}/", flush=True)
        with contextlib.suppress(FileNotFoundError):
            STAMP.unlink()  # an install cut short leaves no stamp
        result = subprocess.run([str(venv_python()), "-m", "pip", "install", "-e", target], cwd=ROOT)
        if result.returncode != 0:
            return result.returncode
        STAMP.write_text(json.dumps({"pyproject": pyproject, "extras": sorted(wanted)}))
    return 0


def _extras(names: set[str]) -> str:
    return f"[{','.join(sorted(names))}]" if names else ""


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
