"""A teacher named by OpenCLIP (`--distill-model NAME --distill-pretrained WEIGHTS`): its weights come from every
source `create_model(NAME, pretrained=...)` takes (an open_clip_train checkpoint here), it runs frozen in `verify`,
a missing tag is one line naming --distill-pretrained, and the teacher-input check compares what the two
processors produce: the same tokenizer read from two directories reads the student's inputs, another tokenizer gets
the teacher its own tokens."""

from __future__ import annotations

import shutil
from pathlib import Path

import open_clip
import pytest
import torch
from openclip_cases import openclip_model, tiny_name
from test_train_loop import tiny_config

from naflexclip import create_model
from naflexclip.cli import main
from naflexclip.families import data_processing
from naflexclip.families import openclip as family
from naflexclip.objectives.distillation import Distill, load_teacher


def _open_clip_train_checkpoint(tmp_path: Path, name: str, seed: int) -> tuple[torch.nn.Module, Path]:
    theirs = openclip_model(name, seed=seed)
    file = tmp_path / "epoch_3.pt"
    torch.save({"epoch": 3, "name": "their-run",
                "state_dict": {f"module.{k}": v for k, v in theirs.state_dict().items()}}, file)
    return theirs, file


def test_an_openclip_teacher_loads_an_open_clip_train_checkpoint_frozen(tmp_path: Path) -> None:
    tiny = tiny_name("ViT-B-16")
    theirs, file = _open_clip_train_checkpoint(tmp_path, tiny, seed=7)
    teacher, processor = load_teacher(tiny, str(file))
    assert processor == f"open_clip:{tiny}" and not teacher.training
    assert not any(p.requires_grad for p in teacher.parameters())
    reference = create_model(tiny, pretrained=str(file))
    assert all(torch.equal(a, b) for a, b in zip(teacher.state_dict().values(), reference.state_dict().values(),
                                                 strict=True))
    pixels = torch.randn(2, 3, 48, 48, generator=torch.Generator().manual_seed(0))
    tokens = open_clip.get_tokenizer(tiny)(["a red circle", "two blue squares"])[:, :teacher.context_length]
    with torch.no_grad():
        expected, ours = theirs(image=pixels, text=tokens), teacher(image=pixels, text=tokens)
    for key in ("image_features", "text_features"):
        assert float((expected[key] - ours[key]).abs().max()) <= 1e-5, key
    random_init = create_model(tiny)
    with torch.no_grad():
        assert float((random_init(image=pixels, text=tokens)["image_features"]
                      - expected["image_features"]).abs().max()) > 1e-2  # the weights are the file's


def test_verify_proves_the_window_with_an_openclip_teacher_from_a_checkpoint_file(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    tiny = tiny_name("ViT-B-16")
    _, file = _open_clip_train_checkpoint(tmp_path, tiny, seed=3)
    assert main(["verify", "--model", tiny, "--splits", "1", "--accum-freq", "2", "--batch-size", "3",
                 "--accum-method", "cache", "--distill-model", tiny, "--distill-pretrained", str(file)]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "contrastive + 1 · distill" in out


def test_a_missing_tag_or_file_of_an_openclip_teacher_is_one_line(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    assert main(["verify", "--model", "tiny", "--distill-model", "ViT-B-16", "--distill-pretrained",
                 "laion2b_s34b_b88k", "--cache-dir", str(tmp_path / "empty")]) == 2
    out = capsys.readouterr().out.strip()
    assert out.count("\n") == 0, out
    assert "--distill-pretrained 'laion2b_s34b_b88k': the weights of ViT-B-16 laion2b_s34b_b88k" in out
    assert "not in a local cache" in out and str(tmp_path / "empty") in out
    assert main(["verify", "--model", "tiny", "--distill-model", "ViT-B-16", "--distill-pretrained",
                 "no-such-tag"]) == 2
    out = capsys.readouterr().out.strip()
    assert out.count("\n") == 0 and "--distill-pretrained 'no-such-tag': not a file, nor a pretrained tag" in out


def test_train_needs_an_openclip_teachers_weights(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--distill-model ViT-B-16 is an OpenCLIP name: give the teacher's weights"):
        tiny_config(tmp_path, "student", distill_model="ViT-B-16")


def _fake_siglip2_tokenizer(directory: Path) -> None:
    from siglip2_cases import tokenizer_vocab
    from transformers.models.siglip2.tokenization_siglip2 import Siglip2Tokenizer

    Siglip2Tokenizer(vocab=tokenizer_vocab(), merges=[], padding_side="right").save_pretrained(directory)


def test_the_teacher_input_check_compares_tokenizers_not_directory_names(tmp_path: Path) -> None:
    """The same tokenizer from another directory: the teacher reads the student's microbatches (nothing extra is
    produced); another tokenizer: the teacher gets its own tokens of the same captions."""
    pytest.importorskip("transformers")
    siglip2 = tiny_name("ViT-B-16-SigLIP2")
    hub = tmp_path / "hub"
    snapshot = hub / "models--timm--ViT-B-16-SigLIP2" / "snapshots" / "abc"
    _fake_siglip2_tokenizer(snapshot)
    student = create_model(siglip2)
    student_processor = family.processor_spec(siglip2, family.tokenizer_dir(siglip2, cache_dir=str(hub)))
    # the teacher's file lies beside its own copy of the same tokenizer: another directory, the same tokens
    weights = tmp_path / "teacher"
    shutil.copytree(snapshot, weights)
    torch.save(openclip_model(siglip2, seed=5).state_dict(), weights / "model.pt")
    distill = Distill(distill_model=siglip2, distill_pretrained=str(weights / "model.pt"))
    teacher, inputs = distill.teacher(student, student_processor, "siglip", cache_dir=str(hub))
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    assert inputs is None
    # a ViT-B-16 student (open_clip's SimpleTokenizer; the same patch size and context length): the teacher gets
    # its own tokens, those of its SigLIP 2 tokenizer
    clip_student = create_model(tiny_name("ViT-B-16"))
    assert (clip_student.image_patch_size, clip_student.context_length) == (8, 16) == (
        teacher.image_patch_size, teacher.context_length)
    _, inputs = distill.teacher(clip_student, f"open_clip:{tiny_name('ViT-B-16')}", "clip", cache_dir=str(hub))
    captions = ["a photo of a red circle."]
    ours = data_processing(student_processor, 8).tokenize(captions, 16)
    assert inputs is not None and torch.equal(inputs.processing.tokenize(captions, 16), ours)
    assert not torch.equal(data_processing(f"open_clip:{tiny_name('ViT-B-16')}", 8).tokenize(captions, 16), ours)
    # and a tokenizer that differs in one token is another input too
    other = tmp_path / "other"
    shutil.copytree(snapshot, other)
    vocab_file = other / "tokenizer.json"
    vocab_file.write_text(vocab_file.read_text().replace('"a": 6', '"a": 7').replace('"b": 7', '"b": 6'))
    _, inputs = distill.teacher(student, family.processor_spec(siglip2, str(other)), "siglip", cache_dir=str(hub))
    assert inputs is not None and (inputs.patch_size, inputs.context_length) == (8, 16)


@pytest.mark.slow
def test_an_openclip_teacher_from_a_naflexclip_run_of_that_name(tmp_path: Path) -> None:
    """A run of an OpenCLIP name records its weight file as `pretrained`: the teacher's name is the run's --model
    (this was refused as "holds a '.../epoch_3.pt' model" before)."""
    from naflexclip.train.loop import train

    tiny = tiny_name("ViT-B-16")
    _, file = _open_clip_train_checkpoint(tmp_path, tiny, seed=2)
    train(tiny_config(tmp_path, "teacher", model=tiny, pretrained=str(file), stop_after_steps=1, val_frequency=0))
    teacher, processor = load_teacher(tiny, str(tmp_path / "teacher" / "checkpoints"))
    assert processor == f"open_clip:{tiny}" and not any(p.requires_grad for p in teacher.parameters())
    with pytest.raises(ValueError, match=r"holds a 'ViT-B-16-tiny' model, not --distill-model 'tiny'"):
        load_teacher("tiny", str(tmp_path / "teacher" / "checkpoints"))
