"""A user-given weight file that is not a checkpoint (a text file, an empty file, a pickle of other objects, a
damaged archive) is refused in one line that names the flag and the path and says what the file is not, at every
place that reads one: `--pretrained`, `--distill-pretrained`, `create_model(pretrained=)`, `eval --checkpoint`,
`verify --checkpoint`. Nothing is unpickled beyond tensors, and torch's advice to load with `weights_only=False`
(arbitrary code execution) never reaches the user."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from openclip_cases import tiny_name

from naflexclip import create_model
from naflexclip.cli import main

FORMS = ["text", "empty", "numpy_pickle", "damaged_archive"]


def _write(tmp_path: Path, form: str) -> Path:
    path = tmp_path / f"{form}.pt"
    if form == "text":
        path.write_text("these are my notes, not weights\n")
    elif form == "empty":
        path.write_bytes(b"")
    elif form == "numpy_pickle":  # a pickle whose objects a weights-only load refuses
        torch.save({"state_dict": {"w": np.zeros(3)}}, path)
    else:
        path.write_bytes(b"PK\x03\x04" + b"\0" * 60)
    return path


def _one_line(text: str, flag: str, path: Path) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert len(lines) == 1, lines
    line = lines[0]
    assert f"{flag} " in line and str(path.name) in line, line
    for advice in ("weights_only", "Weights only", "Traceback", "trust the source", "\x1b["):
        assert advice not in line, line
    assert "not a checkpoint" in line or "not a naflexclip checkpoint" in line or "only tensors" in line, line
    return line


@pytest.mark.parametrize("form", FORMS)
def test_a_file_that_is_not_a_checkpoint_is_one_line_naming_the_flag_and_the_file(
        form: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    tiny = tiny_name("ViT-B-32-quickgelu")
    file = _write(tmp_path, form)
    logs = ["--logs", str(tmp_path / "logs")]

    assert main(["train", "--model", tiny, "--pretrained", str(file), *logs]) == 2
    _one_line(capsys.readouterr().err, "--pretrained", file)
    assert main(["verify", "--model", tiny, "--pretrained", str(file)]) == 2
    captured = capsys.readouterr()
    _one_line(captured.out + captured.err, "--pretrained", file)
    assert main(["train", "--distill-model", tiny, "--distill-pretrained", str(file), *logs]) == 2
    _one_line(capsys.readouterr().err, "--distill-pretrained", file)
    assert main(["train", "--distill-model", "tiny", "--distill-pretrained", str(file), *logs]) == 2
    _one_line(capsys.readouterr().err, "--distill-pretrained", file)
    with pytest.raises(ValueError) as error:
        create_model(tiny, pretrained=str(file))
    _one_line(str(error.value), "--pretrained", file)
    assert main(["eval", "--checkpoint", str(file)]) == 2
    _one_line(capsys.readouterr().err, "--checkpoint", file)
    assert main(["verify", "--checkpoint", str(file)]) == 2
    captured = capsys.readouterr()
    _one_line(captured.out + captured.err, "--checkpoint", file)


def test_a_pickle_of_other_objects_names_what_it_holds(tmp_path: Path) -> None:
    """The refusal says why such a file is not read (objects other than tensors) and names them."""
    file = _write(tmp_path, "numpy_pickle")
    with pytest.raises(ValueError) as error:
        create_model(tiny_name("ViT-B-32-quickgelu"), pretrained=str(file))
    assert "numpy" in str(error.value) and "only tensors" in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("form", ["text", "missing", "empty_folder"])
def test_a_preset_with_a_pretrained_path_that_is_neither_checkpoint_nor_directory_says_what_it_takes(
        form: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`--model tiny --pretrained X`: a preset takes a naflexclip checkpoint or a pretrained model directory. X that
    is neither is one line naming X, what it is and what --pretrained takes with a preset; before, it read "has no
    config.json ...; not an OpenCLIP model (pass --model NAME with --pretrained FILE or TAG)", --model given."""
    path = {"text": tmp_path / "notes.txt", "missing": tmp_path / "absent.pt", "empty_folder": tmp_path / "empty"}[form]
    if form == "text":
        path.write_text("these are my notes, not weights\n")
    elif form == "empty_folder":
        path.mkdir()
    assert main(["train", "--model", "tiny", "--pretrained", str(path), "--logs", str(tmp_path / "logs")]) == 2
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "--pretrained" in lines[0] and path.name in lines[0], lines
    line = lines[0]
    assert "pass --model" not in line and "--model tiny" in line and "naflexclip checkpoint" in line, line
    assert {"text": "is a file", "missing": "does not exist", "empty_folder": "no config.json"}[form] in line, line
