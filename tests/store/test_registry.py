import os

import pytest

from jobs.store.registry import IntegrityError, Registry


def stage(reg, name="m", content=b"weights"):
    tmp = reg.new_tmp_dir(name)
    (tmp / "adapter_model.safetensors").write_bytes(content)
    (tmp / "adapter_config.json").write_text("{}")
    return tmp


def test_publish_is_atomic_and_names_are_never_reused(tmp_path):
    reg = Registry(tmp_path)
    path = reg.publish(stage(reg), "m", 1, {"version": 1})
    assert path.name == "m-v0001" and (path / "manifest.json").exists()
    assert not [p for p in reg.adapters.iterdir() if p.name.startswith(".tmp-")]
    with pytest.raises(FileExistsError):
        reg.publish(stage(reg), "m", 1, {"version": 1})


def test_promote_swaps_current_and_verify_catches_corruption(tmp_path):
    reg = Registry(tmp_path)
    v1 = reg.publish(stage(reg, content=b"one"), "m", 1, {})
    v2 = reg.publish(stage(reg, content=b"two"), "m", 2, {})
    reg.promote(v1)
    assert reg.current() == v1.resolve() and reg.current_version() == 1
    assert not os.path.isabs(os.readlink(reg.current_link))  # relative: the state dir can move
    (v2 / "adapter_model.safetensors").write_bytes(b"tw")  # truncated
    with pytest.raises(IntegrityError, match=r"adapter_model\.safetensors"):
        reg.promote(v2)
    assert reg.current_version() == 1  # the one in service stays


def test_clean_stale_removes_half_written_versions(tmp_path):
    reg = Registry(tmp_path)
    stage(reg)
    assert len(reg.clean_stale()) == 1
    assert list(reg.adapters.iterdir()) == []
