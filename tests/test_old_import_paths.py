"""Modules that moved when the package was arranged by concept still import from their old paths, for one
release: each as the very module it moved to (a patch through either path reaches the one module), with a
DeprecationWarning naming the new path."""

import subprocess
import sys

from naflexclip.old_import_paths import MOVED

CHECK = """
import importlib, sys, warnings
from naflexclip.old_import_paths import MOVED
failures = []
for old, new in MOVED.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    said = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning) and new in str(w.message)]
    if module is not importlib.import_module(new) or not said:
        failures.append(f"{old}: module {module.__name__}, warnings {[str(w.message) for w in caught]}")
print("\\n".join(failures) or "ok")
"""


def test_every_old_path_imports_the_moved_module_with_a_warning():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "ok", out


def test_the_readme_names_keep_working_from_their_old_paths():
    code = ("import warnings\nwarnings.simplefilter('error')\n"
            "from naflexclip import accumulate_gradients, create_loss, create_model\n"
            "from naflexclip.parallel import no_sync_context\n"
            "warnings.simplefilter('ignore')\n"
            "from naflexclip.exchange import window_exchange\n"
            "from naflexclip.parallel.feature_exchange import window_exchange as moved\n"
            "assert window_exchange is moved\n"
            "import naflexclip.model, naflexclip.models.naflex_clip as m\n"
            "assert naflexclip.model.NaFlexClip is m.NaFlexClip\nprint('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


def test_the_table_only_names_paths_that_no_longer_exist_as_files():
    """An old path that is still a file would shadow nothing and warn for nothing: the table lists moves only."""
    import importlib.util

    import naflexclip

    assert naflexclip  # the finder is installed by importing the package
    for old in MOVED:
        spec = importlib.util.find_spec(old)
        assert spec is not None and spec.origin is None, f"{old} is still a file ({spec and spec.origin})"
