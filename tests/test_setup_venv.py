"""`scripts/setup_venv.py`, where both README commands start: one after the other, the second installs only what
the first did not; at once, the second waits for the first (one lock around the venv and every pip run)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "setup_venv.py"


@pytest.fixture
def setup_venv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[ModuleType, list[list[str]]]:
    """The script's module over a repository in `tmp_path`, with venv creation and pip recorded, not run."""
    spec = importlib.util.spec_from_file_location("setup_venv", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\ndependencies = ['torch>=2.7']\n")
    monkeypatch.setattr(module, "ROOT", tmp_path)
    monkeypatch.setattr(module, "VENV", tmp_path / ".venv")
    monkeypatch.setattr(module, "OLDEST_TORCH_VENV", tmp_path / ".venv-oldest")
    monkeypatch.setattr(module, "LOCK", tmp_path / ".venv.lock")

    def create(path: Path, with_pip: bool) -> None:
        module.venv_python(path).parent.mkdir(parents=True)
        module.venv_python(path).write_text("")

    pip_runs: list[list[str]] = []

    def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
        pip_runs.append(argv[argv.index("-e") + 1:])
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(module.venv, "create", create)
    monkeypatch.setattr(module.subprocess, "run", run)
    return module, pip_runs


def test_the_second_command_installs_only_what_the_first_did_not(setup_venv) -> None:
    module, pip_runs = setup_venv
    assert module.main([]) == 0
    assert module.main(["test", "benchmark"]) == 0
    assert module.main(["test"]) == 0 and module.main([]) == 0  # nothing left to install
    assert pip_runs == [["."], [".[benchmark,test]"]]


def test_a_changed_pyproject_or_a_failed_install_installs_again(setup_venv) -> None:
    module, pip_runs = setup_venv
    assert module.main(["test"]) == 0
    (module.ROOT / "pyproject.toml").write_text("[project]\nname = 'y'\ndependencies = ['torch>=2.7']\n")
    assert module.main(["test"]) == 0
    module.subprocess.run = lambda argv, cwd: (pip_runs.append(argv[-1:]), subprocess.CompletedProcess(argv, 1))[1]
    stamp = module.VENV / module.STAMP
    stamp.unlink()
    assert module.main(["test"]) == 1  # pip's failure is the command's
    assert not stamp.exists()  # so the next run tries again
    assert pip_runs == [[".[test]"], [".[test]"], [".[test]"]]


def test_oldest_torch_installs_the_floor_of_pyproject_into_its_own_venv(setup_venv) -> None:
    module, pip_runs = setup_venv
    pyproject = module.ROOT / "pyproject.toml"
    pyproject.write_text("[project]\nname = 'x'\ndependencies = ['numpy', 'torch >= 2.5.1, <3', 'torchvision']\n")
    assert module.main(["test"]) == 0
    assert module.main(["--oldest-torch", "test"]) == 0
    assert module.main(["--oldest-torch", "test"]) == 0  # up to date
    assert pip_runs == [[".[test]"], [".[test]", "torch==2.5.1"]]
    assert (module.OLDEST_TORCH_VENV / module.STAMP).is_file() and (module.VENV / module.STAMP).is_file()


def test_oldest_torch_without_a_floor_says_so(setup_venv) -> None:
    module, pip_runs = setup_venv
    (module.ROOT / "pyproject.toml").write_text("[project]\nname = 'x'\ndependencies = ['torch']\n")
    with pytest.raises(SystemExit, match="'torch' names no lowest torch"):
        module.main(["--oldest-torch"])
    assert pip_runs == [] and not module.OLDEST_TORCH_VENV.exists()


def test_two_setups_at_once_take_turns(tmp_path: Path) -> None:
    """A second process waits for the lock the first holds (the venv and pip run under it)."""
    lock = tmp_path / ".venv.lock"
    holder = ("import sys, time, importlib.util as u; s = u.spec_from_file_location('s', sys.argv[1]); "
              "m = u.module_from_spec(s); s.loader.exec_module(m)\n"
              "with m.locked(__import__('pathlib').Path(sys.argv[2])):\n"
              "    print('held', flush=True); time.sleep(2)\n")
    first = subprocess.Popen([sys.executable, "-c", holder, str(SCRIPT), str(lock)], stdout=subprocess.PIPE,
                             text=True)
    assert first.stdout is not None and first.stdout.readline().strip() == "held"
    spec = importlib.util.spec_from_file_location("setup_venv_lock", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    started = time.monotonic()
    with module.locked(lock):
        waited = time.monotonic() - started
    first.wait()
    assert waited > 0.5
