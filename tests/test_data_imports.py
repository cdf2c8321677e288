"""The data pipeline is handed its tokenizer and patching; it never reaches up into the pretrained families."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import naflexclip.data
from naflexclip.data import DataConfig, build_loader
from naflexclip.processing.naflex_transform import default_processing

DATA_DIR = Path(naflexclip.data.__file__).parent


def test_no_module_of_the_data_package_imports_the_families_even_lazily():
    offenders = []
    for file in sorted(DATA_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(file.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{file.name}:{node.lineno} {name}" for name in names
                          if name.startswith(("naflexclip.families", "naflexclip.models"))]
    assert offenders == []


# records every import statement a naflexclip.data module executes (the import graph's edges out of it)
_RECORD_IMPORTS = """
import builtins, importlib.util
edges, real_import = set(), builtins.__import__
def recording_import(name, globals=None, locals=None, fromlist=(), level=0):
    importer = (globals or {}).get("__name__", "")
    if importer.startswith("naflexclip.data"):
        base = importlib.util.resolve_name("." * level + name, globals.get("__package__")) if level else name
        edges.update((importer, target) for target in [base, *(f"{base}.{f}" for f in fromlist or ())])
    return real_import(name, globals, locals, fromlist, level)
builtins.__import__ = recording_import
"""


def test_the_data_package_imports_no_family_when_imported_and_used():
    """Import every data module and read a microbatch: no import statement of theirs names the families."""
    modules = sorted(f"naflexclip.data.{file.stem}" for file in DATA_DIR.glob("*.py") if file.stem != "__init__")
    code = _RECORD_IMPORTS + (
        f"import importlib\nfor m in {modules!r}: importlib.import_module(m)\n"
        "from naflexclip.data import DataConfig, build_loader, build_zero_shot_loader\n"
        "cfg = DataConfig(synthetic_train_size=8, naflex_seq_lens=(16,), naflex_max_tokens_per_batch=64, workers=0)\n"
        "next(iter(build_loader(cfg, split='train', patch_size=4, context_length=8)))\n"
        "next(iter(build_zero_shot_loader(cfg, patch_size=4, context_length=8, num_samples=4)))\n"
        "print(len(edges))\n"
        "print(sorted(edge for edge in edges if edge[1].startswith('naflexclip.families')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    count, families = out.stdout.strip().splitlines()
    assert int(count) > 20  # the hook saw the data modules' imports
    assert families == "[]"


def test_a_handed_processing_is_what_the_loader_uses():
    cfg = DataConfig(synthetic_train_size=8, naflex_seq_lens=(16,), naflex_max_tokens_per_batch=64, workers=0)
    ours = default_processing(4)
    constant = type(ours)(ours.transform, ours.collate, lambda texts, length: torch.full((len(texts), length), 7))
    batch = next(iter(build_loader(cfg, split="train", patch_size=4, context_length=8, processing=constant)))
    assert bool((batch["text"] == 7).all())
    default = next(iter(build_loader(cfg, split="train", patch_size=4, context_length=8)))
    assert torch.equal(default["image"]["patches"], batch["image"]["patches"])
    assert not bool((default["text"] == 7).all())


def test_a_pretrained_data_config_without_its_processing_is_one_line():
    cfg = DataConfig(hf_processor="some/siglip2-dir", synthetic_train_size=8)
    with pytest.raises(ValueError, match="processing") as info:
        build_loader(cfg, split="train", patch_size=4, context_length=8)
    assert "\n" not in str(info.value) and "some/siglip2-dir" in str(info.value)
