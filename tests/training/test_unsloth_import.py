"""import_unsloth: Unsloth's PatchFastRL runs PatchRL on the model class but not the TRL trainer rewrite
(a package laid out like Unsloth 2026.10's: models/rl.py defines both, models/llama.py calls it at import)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from jobs.training.backends.unsloth_import import import_unsloth

CALLS: list[str] = []

FAKE = {
    "__init__.py": "from .models import llama\n",
    "models/__init__.py": "",
    "models/rl.py": """
        from tests.training.test_unsloth_import import CALLS

        def PatchRL(FastLanguageModel):
            CALLS.append("PatchRL " + FastLanguageModel.__name__)

        def patch_trl_rl_trainers():
            CALLS.append("rewrite trainers")

        def PatchFastRL(algorithm=None, FastLanguageModel=None):
            if FastLanguageModel is not None:
                PatchRL(FastLanguageModel)
            patch_trl_rl_trainers()
    """,
    "models/llama.py": """
        from .rl import PatchFastRL

        class FastLlamaModel:
            pass

        PatchFastRL(FastLanguageModel=FastLlamaModel)
    """,
}


@pytest.fixture
def fake_unsloth(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    for name, text in FAKE.items():
        f = tmp_path / "unsloth" / name
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    for m in [m for m in sys.modules if m == "unsloth" or m.startswith("unsloth.")]:
        monkeypatch.delitem(sys.modules, m)
    CALLS.clear()
    yield
    for m in [m for m in sys.modules if m == "unsloth" or m.startswith("unsloth.")]:
        del sys.modules[m]


def test_the_trainer_rewrite_is_skipped_and_the_model_class_patched(fake_unsloth) -> None:
    finders = list(sys.meta_path)
    assert import_unsloth() is True
    assert CALLS == ["PatchRL FastLlamaModel"]
    assert sys.meta_path == finders  # the import hook is gone again
    assert import_unsloth() is True  # asked again in the same process: already imported that way


def test_imported_whole_when_asked(fake_unsloth) -> None:
    assert import_unsloth(trl_trainers=True) is False
    assert CALLS == ["PatchRL FastLlamaModel", "rewrite trainers"]


def test_an_unsloth_without_the_pair_is_left_as_it_is(fake_unsloth, tmp_path: Path) -> None:
    (tmp_path / "unsloth" / "models" / "rl.py").write_text(textwrap.dedent("""
        from tests.training.test_unsloth_import import CALLS

        def PatchFastRL(algorithm=None, FastLanguageModel=None):
            CALLS.append("its own PatchFastRL")
    """))
    assert import_unsloth() is False
    assert CALLS == ["its own PatchFastRL"]
