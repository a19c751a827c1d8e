"""The README documents every configuration key, and its commands are the ones CI runs."""

import re
import typing

from pydantic import BaseModel

from daemon.settings import Settings
from tests.conftest import REPO

README = (REPO / "README.md").read_text()


def keys():
    for name, field in Settings.model_fields.items():
        ann = field.annotation
        args = typing.get_args(ann)
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else next(
            (a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if model is None:
            yield name, name
        else:
            for sub in model.model_fields:
                yield name, sub


def test_every_settings_key_is_in_the_readme():
    missing = [f"[{section}] {key}" for section, key in keys() if not re.search(rf"`[^`]*\b{key}\b[^`]*`", README)]
    assert not missing, f"undocumented keys: {missing}"


def test_ci_runs_the_readme_test_command():
    blocks = re.findall(r"```bash\n(.*?)```", README, re.S)
    test_cmds = [line for b in blocks for line in b.splitlines() if "pytest" in line]
    assert len(blocks) >= 2 and test_cmds
    ci = (REPO / ".ci" / "run").read_text()
    assert all(cmd in ci for cmd in test_cmds)
