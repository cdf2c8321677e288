"""Set up `.venv` in the repository with naflexclip installed (editable) and the extras named, then exit.

    python3 scripts/setup_venv.py                   # the package: what the demo needs
    python3 scripts/setup_venv.py test benchmark    # and the extras the test suite needs
    python3 scripts/setup_venv.py --oldest-torch test benchmark   # the same in .venv-oldest, with the oldest
                                                    # torch pyproject.toml allows (CI tests it too)

The README's two commands both start here. Run one after the other, the second installs only what the first did
not (nothing at all when its extras are already installed from the same pyproject.toml). Run at once, the second
waits for the first: one lock file serialises the venv's creation and every pip run in it, so two pip processes
never write the same site-packages. Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
import venv
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
OLDEST_TORCH_VENV = ROOT / ".venv-oldest"  # the same install, torch held to the floor of pyproject.toml
LOCK = ROOT / ".venv.lock"
STAMP = "naflexclip-install.json"  # in each venv: what this script last installed, and from which pyproject.toml


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


def venv_python(folder: Path) -> Path:
    return folder / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def installed(folder: Path) -> tuple[str, set[str]]:
    """The pyproject.toml hash and the extras of the last install in `folder` ("" and none if there was none)."""
    try:
        stamp = json.loads((folder / STAMP).read_text())
        return str(stamp["pyproject"]), set(stamp["extras"])
    except (OSError, ValueError, KeyError, TypeError):
        return "", set()


def torch_floor() -> str:
    """The lowest torch `[project] dependencies` in pyproject.toml allow (the X of `torch>=X`)."""
    import tomllib  # Python 3.11: only this option needs it

    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for requirement in dependencies:
        if re.match(r"torch\s*($|[<>=!~;,\[])", requirement):
            floor = re.search(r">=\s*([\w.]+)", requirement)
            if floor is None:
                raise SystemExit(f"pyproject.toml: {requirement!r} names no lowest torch (>=) to install")
            return floor.group(1)
    raise SystemExit("pyproject.toml: torch is not among [project] dependencies")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="Set up .venv with naflexclip (editable) and the extras named.")
    parser.add_argument("extras", nargs="*", help="extras of pyproject.toml to install besides, e.g. test benchmark")
    parser.add_argument("--oldest-torch", action="store_true",
                        help=f"set up {OLDEST_TORCH_VENV.name}/ instead, with the oldest torch pyproject.toml allows "
                             "(and the torchvision made for it)")
    args = parser.parse_args(argv)
    folder = OLDEST_TORCH_VENV if args.oldest_torch else VENV
    # torchvision pins the torch it was built for: pip picks the one made for this torch by itself
    pins = [f"torch=={torch_floor()}"] if args.oldest_torch else []
    with locked(LOCK):
        if not venv_python(folder).exists():
            print(f"creating {folder.name}/", flush=True)
            venv.create(folder, with_pip=True)
        pyproject = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
        done_for, done_extras = installed(folder)
        wanted = set(args.extras) | (done_extras if done_for == pyproject else set())
        what = f"naflexclip{_extras(wanted)}{''.join(f' {pin}' for pin in pins)}"
        if done_for == pyproject and wanted <= done_extras:
            print(f"{folder.name}/ is up to date ({what})", flush=True)
            return 0
        print(f"installing {what} into {folder.name}/", flush=True)
        stamp = folder / STAMP
        with contextlib.suppress(FileNotFoundError):
            stamp.unlink()  # an install cut short leaves no stamp
        result = subprocess.run([str(venv_python(folder)), "-m", "pip", "install", "-e", f".{_extras(wanted)}",
                                 *pins], cwd=ROOT)
        if result.returncode != 0:
            return result.returncode
        stamp.write_text(json.dumps({"pyproject": pyproject, "extras": sorted(wanted)}))
    return 0


def _extras(names: set[str]) -> str:
    return f"[{','.join(sorted(names))}]" if names else ""


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
