"""Nights of a GPT-OSS-architecture mixture of experts on the CPU (issue 15): LoRA on attention and every
expert's projections (PEFT target_parameters), packed steps, the expert LoRA check in the manifest, and a
night whose experts get no gradient failing loudly with nothing published."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jobs.store.ledger import Ledger
from tests.conftest import REPO, alpaca, hang_bound, run, write_jsonl

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    """A random-initialised GPT-OSS (2 layers, 4 experts, top-2, sinks, a sliding window of 8) with the
    demo model's BPE tokenizer and chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jobs.training.models.architectures import make_config

    tok = AutoTokenizer.from_pretrained(tiny_model)
    cfg = make_config("tiny-gpt-oss")
    cfg.vocab_size = len(tok)
    cfg.bos_token_id, cfg.pad_token_id = tok.bos_token_id, tok.pad_token_id
    cfg.eos_token_id = tok.convert_tokens_to_ids("<|end|>")
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("moe") / "tiny-gpt-oss"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _config(tmp_path: Path, model: Path) -> tuple[Path, Path]:
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    cfg = tmp_path / "nightshift.toml"
    cfg.write_text(f"""
state_dir = "{tmp_path / "state"}"
[model]
path = "{model}"
name = "moe"
[[sources]]
name = "inbox"
inbox = "{inbox}"
settle_seconds = 0
[plan]
prior_tokens_per_second = 2000
prior_overhead_seconds = 0
heldout_share = 0.1
[train]
backend = "hf"
batching = "packed"
tokens_per_step = 384
lora_rank = 4
lora_alpha = 8
learning_rate = 2e-3
max_seq_length = 128
gradient_checkpointing = false
target_modules = "all-linear"
[gpu]
enabled = false
""")
    return cfg, inbox


def test_a_gpt_oss_night_through_the_cli_trains_every_expert_and_publishes(tmp_path, tiny_moe):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jobs.training.moe.lora import expected_lora_parameters

    cfg, inbox = _config(tmp_path, tiny_moe)
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(80)])
    r = subprocess.run([sys.executable, "-m", "daemon", "--config", str(cfg), "once"], cwd=REPO,
                       capture_output=True, text=True, timeout=hang_bound(300))
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"outcome\s+succeeded", r.stdout) and re.search(r"version\s+moe-v0001 \(promoted", r.stdout)
    assert re.search(r"expert LoRA\s+8 tensors, 8 with gradient, 8 moved", r.stdout), r.stdout
    current = tmp_path / "state" / "current"
    manifest = json.loads((current / "manifest.json").read_text())
    t = manifest["training"]
    expected = expected_lora_parameters(AutoModelForCausalLM.from_pretrained(tiny_moe).config, 4)
    assert t["batching"] == "packed" and t["steps"] >= 4
    assert t["trainable_parameters"] == expected["total"] and t["trainable_in_experts"] == expected["experts"]
    e = t["expert_lora"]
    assert (e["tensors"], e["with_grad"], e["moved"], e["nonfinite"], e["problems"]) == (8, 8, 8, 0, [])
    assert e["parameters"] == expected["experts"] and e["slices_moved"] == e["expert_slices"] == 32
    adapter_cfg = json.loads((current / "adapter_config.json").read_text())
    assert adapter_cfg["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert sorted(adapter_cfg["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]  # not the router

    # a consumer: peft loads the version onto the base (stock attention), the experts' adapters included
    base = AutoModelForCausalLM.from_pretrained(tiny_moe)
    tok = AutoTokenizer.from_pretrained(tiny_moe)
    model = PeftModel.from_pretrained(base, str(current))
    b = [p for n, p in model.named_parameters() if ".experts." in n and "lora_B" in n]
    assert len(b) == 4 and all(float(p.abs().sum()) > 0 for p in b)
    ids = tok.apply_chat_template([{"role": "user", "content": "Add 3 and 4."}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids["input_ids"].shape[1]


def test_a_night_whose_experts_get_no_gradient_fails_loudly_and_publishes_nothing(night_env, tiny_moe,
                                                                                   monkeypatch):
    """The #606 failure (the experts' forward ignores their LoRA): caught after the first passes, the run
    closed as failed (a retry would fail alike), no version, nothing in service, the samples still pending."""
    from peft.tuners.lora.layer import ParamWrapper

    monkeypatch.setattr(ParamWrapper, "forward", lambda self, x, *a, **k: self.get_base_layer()(x, *a, **k))
    inbox, make = night_env
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(120)])
    cfg = make(model={"path": tiny_moe, "name": "moe"}, plan={"heldout_share": 0},
               train={"batching": "packed", "tokens_per_step": 256, "lora_alpha": 8})
    s = run(cfg)
    assert s["outcome"] == "failed"
    assert "expert LoRA check failed" in s["error"] and "received no gradient on the first 3 passes" in s["error"]
    assert s["expert_lora"]["tensors"] == 8 and s["expert_lora"]["with_grad"] == 0
    assert s["steps"] is None  # failed inside the 4th step, long before the window's end
    state = Path(cfg.state_dir)
    assert not (state / "current").exists()
    assert not list(state.glob("adapters/moe-v*"))
    led = Ledger(state / "ledger.sqlite")
    assert led.run(s["run_id"])["status"] == "failed" and led.night_done("2026-11-21")
    assert led.sample_counts() == {"pending": 120}
    assert led.versions() == []  # nothing was published: the reserved number is given back


def test_nights_from_a_model_built_in_memory_continue_their_adapter(night_env, tmp_path):
    """`[model] build = "in-memory:<arch>"`: config and tokenizer on disk, the weights drawn in (GPU) memory
    each night (GPT-OSS-120B's outgrow the disk); the second night continues the first one's adapter."""
    from jobs.night.config import ModelConfig

    inbox, make = night_env
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(40)])
    cfg = make(model={"path": tmp_path / "models" / "tiny-gpt-oss", "name": "mem", "build": "in-memory:tiny-gpt-oss"},
               plan={"heldout_share": 0}, train={"batching": "packed", "tokens_per_step": 512, "lora_alpha": 8})
    s1 = run(cfg)
    assert s1["outcome"] == "succeeded", s1["error"]
    assert not list(Path(cfg.model.path).glob("*.safetensors"))  # nothing of the weights on disk
    t = json.loads((Path(cfg.state_dir) / "current" / "manifest.json").read_text())["training"]
    assert t["backend"] == "nightshift-moe" and t["built_in_memory"] and t["trainable_matches_expected"]
    assert t["expert_lora"]["tensors"] == 8 and t["expert_lora"]["moved"] == 8
    write_jsonl(inbox / "b.jsonl", [alpaca(i, " again") for i in range(30)])
    s2 = run(cfg, night="2026-11-22")
    assert s2["outcome"] in ("succeeded", "rejected") and s2["parent_version"] == 1, s2["error"]
    assert s2["load_info"]["parent_adapter"].endswith("mem-v0001") and s2["expert_lora"]["with_grad"] == 8
    with pytest.raises(ValueError, match="known arch"):
        ModelConfig(path=tmp_path, build="in-memory:gpt-5")
