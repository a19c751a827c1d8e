import pytest

from daemon.settings import ConfigError, check_paths, load_settings


def write(tmp_path, text):
    p = tmp_path / "n.toml"
    p.write_text(text)
    return p


def test_the_embedded_default_config_is_valid():
    s = load_settings()
    assert s.model.build == "tiny-llama" and s.sources[0].name == "samples"
    assert check_paths(s) == []


def test_every_wrong_key_is_reported_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("NIGHTSHIFT_PLAN__SAFETY_FACTOR", "7")
    p = write(tmp_path, """
bogus = 1
[model]
pth = "x"
[train]
lora_rank = 0
lora_rnak = 8
backend = "cuda"
[[sources]]
name = "ok"
""")
    with pytest.raises(ConfigError) as e:
        load_settings(p)
    text = str(e.value)
    for expected in ["bogus: unknown key", "[model] pth: unknown key", "[model] path: required key is missing",
                     "[train] lora_rank:", "[train] lora_rnak: unknown key", "[train] backend:",
                     "[[sources]] #1 inbox: required key is missing",
                     "[plan] safety_factor:", "NIGHTSHIFT_PLAN__SAFETY_FACTOR"]:
        assert expected in text, expected
    assert len(e.value.problems) == 8


def test_environment_overrides_toml(tmp_path, monkeypatch):
    p = write(tmp_path, '[model]\npath = "m"\n[train]\nlora_rank = 8\n')
    monkeypatch.setenv("NIGHTSHIFT_TRAIN__LORA_RANK", "32")
    assert load_settings(p).train.lora_rank == 32


def test_toml_syntax_error_names_the_line(tmp_path):
    with pytest.raises(ConfigError, match="line 2"):
        load_settings(write(tmp_path, '[model]\npath = \n'))


def test_check_paths_lists_missing_things(tmp_path):
    s = load_settings(write(tmp_path, f'[model]\npath = "{tmp_path}/none"\n[[sources]]\nname = "a"\n'
                                      f'inbox = "{tmp_path}/nope"\n[eval]\nregression_set = "{tmp_path}/r.jsonl"\n'))
    problems = check_paths(s)
    assert len(problems) == 3 and any("[[sources]] #1 inbox" in p for p in problems)
