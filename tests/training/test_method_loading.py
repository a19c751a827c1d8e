"""What each method asks of Unsloth (a stand-in `unsloth` module records the call, CPU), and what
a version and its continuation are, by method."""

from __future__ import annotations

import json
import shutil
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jobs.contract import Method
from jobs.training.backends.unsloth import LoraSpec, base_cache_key, load_unsloth, refused_marker
from jobs.training.backends.unsloth_lora import DEFAULT_TARGETS, attach_lora, spec_for
from jobs.training.load import check_start


class Called(BaseException):
    """The stand-in's stop at a call: not an Exception, so no fallback of the load catches it."""

    def __init__(self, who: str, kwargs: dict[str, Any]) -> None:
        super().__init__(who)
        self.who, self.kwargs = who, kwargs


@pytest.fixture
def fake_unsloth(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """`unsloth` whose loaders stop at the call with its arguments (the environment setup_caches sets is restored)."""
    import torch

    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "UNSLOTH_DISABLE_STATISTICS",
              "PYTORCH_CUDA_ALLOC_CONF", "TORCH_COMPILE_JOB_ID"):
        monkeypatch.setenv(k, "x")

    def loader(who: str) -> Any:
        def from_pretrained(**kwargs: Any) -> Any:
            raise Called(who, kwargs)
        return type(who, (), {"from_pretrained": staticmethod(from_pretrained)})

    root = types.ModuleType("unsloth")
    root.FastLanguageModel = loader("FastLanguageModel")  # type: ignore[attr-defined]
    root.FastModel = loader("FastModel")  # type: ignore[attr-defined]
    utils = types.ModuleType("unsloth.utils")
    dispatch = types.ModuleType("unsloth.utils.attention_dispatch")
    dispatch._TORCH_VARLEN_ATTN = object()  # type: ignore[attr-defined]  # "native": nothing to patch
    utils.attention_dispatch = dispatch  # type: ignore[attr-defined]
    for name, mod in (("unsloth", root), ("unsloth.utils", utils), ("unsloth.utils.attention_dispatch", dispatch)):
        monkeypatch.setitem(sys.modules, name, mod)
    # torch's own patch restores job_id; monkeypatch.setattr (pytest >= 9.2) would delete it from torch's config
    with torch.compiler.config.patch(job_id=torch.compiler.config.job_id):
        yield


def call(model: Path, method: str, **kw: Any) -> Called:
    with pytest.raises(Called) as e:
        load_unsloth(model, lora=LoraSpec(), method=method, max_seq_length=4096, **kw)
    return e.value


def test_qlora_and_lora_differ_only_in_the_base_precision(fake_unsloth, tiny_model):
    q, lo = call(tiny_model, "qlora"), call(tiny_model, "lora")
    assert q.who == lo.who == "FastLanguageModel"  # the same fast path: packed varlen, LoRA kernels
    assert q.kwargs["load_in_4bit"] is True and "load_in_16bit" not in q.kwargs
    assert lo.kwargs["load_in_4bit"] is False and lo.kwargs["load_in_16bit"] is True
    same = {k: v for k, v in q.kwargs.items() if k != "load_in_4bit"}
    assert {k: v for k, v in lo.kwargs.items() if k not in ("load_in_4bit", "load_in_16bit")} == same


def test_lora_skips_the_nf4_cache_and_refuses_a_quantised_base(fake_unsloth, tiny_model, tmp_path):
    assert call(tiny_model, "lora", cache_dir=tmp_path).kwargs["model_name"] == str(tiny_model)  # never a cache
    quantised = tmp_path / "nf4"
    quantised.mkdir()
    (quantised / "config.json").write_text('{"quantization_config": {"load_in_4bit": true}}')
    with pytest.raises(ValueError, match=r'method = "lora" trains on a 16-bit base, but .* is quantised'):
        load_unsloth(quantised, lora=LoraSpec(), method="lora")


def test_full_is_unsloths_full_fine_tuning_of_the_model_in_service(fake_unsloth, tiny_model, tmp_path):
    f = call(tiny_model, "full", parent_adapter=tmp_path / "tiny-v0003", gradient_checkpointing=True)
    assert f.who == "FastModel" and f.kwargs["full_finetuning"] is True and f.kwargs["load_in_4bit"] is False
    assert f.kwargs["model_name"] == str(tmp_path / "tiny-v0003")  # continues the version, not the base
    assert f.kwargs["tokenizer_name"] == str(tiny_model) and f.kwargs["use_gradient_checkpointing"] == "unsloth"
    assert call(tiny_model, "full").kwargs["model_name"] == str(tiny_model)  # first night: the base


def test_what_a_night_continues_must_match_its_method(tmp_path):
    adapter, model = tmp_path / "adapter", tmp_path / "model"
    for d, f in ((adapter, "adapter_config.json"), (model, "config.json")):
        d.mkdir()
        (d / f).write_text("{}")
    check_start(adapter, Method.qlora)
    check_start(model, Method.full)
    with pytest.raises(ValueError, match=r'method = "lora" continues a LoRA adapter, but .*model is not one'):
        check_start(model, Method.lora)
    with pytest.raises(ValueError, match=r'method = "full" continues a whole model, but .*adapter is a LoRA adapter'):
        check_start(adapter, Method.full)


def test_a_rank_of_several_loads_onto_its_own_card_and_one_process_as_before(fake_unsloth, tiny_model, monkeypatch):
    """torchrun's rank with local rank 1 has bound card 1 (jobs/training/ranks/collectives.py bind_device): every
    loader puts the model there, not on card 0; one process passes no device_map (Unsloth's default)."""
    import torch

    assert "device_map" not in call(tiny_model, "qlora").kwargs
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    for method in ("qlora", "lora", "full"):
        assert call(tiny_model, method).kwargs["device_map"] == {"": 1}, method


def test_a_torchao_peft_refuses_is_hidden_from_the_transformers_path(monkeypatch):
    """Unsloth accepts torchao 0.13+, PEFT 0.21 refuses any LoRA on a 16-bit layer below 0.16 (every `lora`
    night on the hf path failed on the GPU machine): a process that has not imported it stops seeing it."""
    import sys

    import peft.import_utils as pi

    from jobs.training.backends.peft_env import hide_torchao_peft_refuses

    def refuses():
        if sys.modules.get("torchao", 0) is None:
            return False
        raise ImportError("Found an incompatible version of torchao. Found version 0.14.1")

    refuses.cache_clear = lambda: None
    monkeypatch.setattr(pi, "is_torchao_available", refuses)
    monkeypatch.delitem(sys.modules, "torchao", raising=False)
    assert hide_torchao_peft_refuses() is True
    assert sys.modules["torchao"] is None and refuses() is False
    monkeypatch.setitem(sys.modules, "torchao", object())  # imported already (Unsloth's process): left alone
    assert hide_torchao_peft_refuses() is False
    monkeypatch.setattr(pi, "is_torchao_available", lambda: False)  # nothing to hide
    monkeypatch.delitem(sys.modules, "torchao")
    assert hide_torchao_peft_refuses() is False and "torchao" not in sys.modules


def test_an_unsloth_without_the_patched_modules_is_left_as_shipped(fake_unsloth, monkeypatch):
    """The step's patches of Unsloth internals (varlen dispatch, packed labels) answer "unavailable" on an Unsloth
    that lacks the module they patch, rather than stopping the load (CI's first run: ImportError)."""
    from jobs.training.backends.unsloth import enable_async_packed_labels, enable_varlen_attention

    assert enable_async_packed_labels() == "unavailable"  # the stand-in has no unsloth.utils.packing
    monkeypatch.delitem(sys.modules, "unsloth.utils.attention_dispatch")
    monkeypatch.delattr(sys.modules["unsloth.utils"], "attention_dispatch")
    assert enable_varlen_attention() == "unavailable"


def cached_copy(model: Path, cache_dir: Path) -> Path:
    """The NF4 copy of `model` as an earlier night leaves it in the cache."""
    c = cache_dir / "bases" / base_cache_key(model)
    c.mkdir(parents=True)
    (c / "config.json").write_text("{}")
    (c / "nightshift_base.json").write_text("{}")
    return c


def test_a_base_with_experts_is_never_cached(fake_unsloth, tiny_model, tmp_path):
    """Transformers' save keeps no quantisation state for fused 4-bit experts and Unsloth refuses the copy: every
    GPT-OSS QLoRA night after the first failed on it (H200). A dense base still loads its copy."""
    dense = cached_copy(tiny_model, tmp_path / "dense")
    assert call(tiny_model, "qlora", cache_dir=tmp_path / "dense").kwargs["model_name"] == str(dense)
    moe = tmp_path / "moe"
    shutil.copytree(tiny_model, moe)
    cfg = json.loads((moe / "config.json").read_text())
    (moe / "config.json").write_text(json.dumps({**cfg, "num_local_experts": 4, "num_experts_per_tok": 2}))
    cached_copy(moe, tmp_path / "moe-cache")
    assert call(moe, "qlora", cache_dir=tmp_path / "moe-cache").kwargs["model_name"] == str(moe)


def test_a_cached_base_unsloth_refuses_is_set_aside_and_the_source_loaded(fake_unsloth, tiny_model, tmp_path,
                                                                          monkeypatch):
    cache = cached_copy(tiny_model, tmp_path)
    tried: list[str] = []

    def from_pretrained(**kwargs: Any) -> Any:
        tried.append(kwargs["model_name"])
        if kwargs["model_name"] == str(cache):
            raise RuntimeError("fused expert weights were saved without their bitsandbytes quantization state")
        raise Called("FastLanguageModel", kwargs)

    monkeypatch.setattr(sys.modules["unsloth"].FastLanguageModel, "from_pretrained", staticmethod(from_pretrained))
    assert call(tiny_model, "qlora", cache_dir=tmp_path).kwargs["model_name"] == str(tiny_model)
    assert tried == [str(cache), str(tiny_model)] and not cache.exists()
    assert "quantization state" in json.loads(refused_marker(cache).read_text())["refused"]
    tried.clear()  # the next night loads the source at once (and writes no copy again)
    assert call(tiny_model, "qlora", cache_dir=tmp_path).kwargs["model_name"] == str(tiny_model)
    assert tried == [str(tiny_model)]


def gpt_oss_like() -> Any:
    """GPT-OSS's module names: attention projections, a router and fused 3-D expert weights, two layers."""
    import torch
    from torch import nn

    def layer() -> nn.Module:
        attn, experts, mlp, block = nn.Module(), nn.Module(), nn.Module(), nn.Module()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(attn, name, nn.Linear(4, 4))
        experts.gate_up_proj = nn.Parameter(torch.zeros(2, 4, 8))
        experts.down_proj = nn.Parameter(torch.zeros(2, 4, 4))
        mlp.router, mlp.experts = nn.Linear(4, 2), experts
        block.self_attn, block.mlp = attn, mlp
        return block

    inner, root = nn.Module(), nn.Module()
    inner.layers = nn.ModuleList([layer(), layer()])
    root.model = inner
    return root


# what Unsloth 2026.10.9 saved for GPT-OSS's first night of `target_modules = "all-linear"` (H200)
GPT_OSS_PARENT = {
    "r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
    "target_modules": r"(?:model\.layers\.\d+\.self_attn\.k_proj|model\.layers\.\d+\.self_attn\.o_proj|"
                      r"model\.layers\.\d+\.self_attn\.q_proj|model\.layers\.\d+\.self_attn\.v_proj)",
    "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
}


def test_a_parent_saved_as_a_regex_over_attention_and_fused_experts_is_continued_with_its_names(
        fake_unsloth, tmp_path, monkeypatch):
    """GPT-OSS's second night handed Unsloth the parent's regex as a module name: "No layers to finetune" on every
    path (H200). It gets back the names of its first night: the regex read as PEFT reads it, the experts by name."""
    parent = tmp_path / "v0001"
    parent.mkdir()
    (parent / "adapter_config.json").write_text(json.dumps(GPT_OSS_PARENT))
    spec = spec_for(LoraSpec(r=16, target_modules="all-linear"), parent)
    assert (spec.r, spec.alpha) == (8, 16)
    assert spec.names_on(gpt_oss_like()) == sorted(DEFAULT_TARGETS)

    def get_peft_model(model: Any, **kwargs: Any) -> Any:
        raise Called("get_peft_model", kwargs)

    monkeypatch.setattr(sys.modules["unsloth"].FastLanguageModel, "get_peft_model", staticmethod(get_peft_model),
                        raising=False)
    with pytest.raises(Called) as e:
        attach_lora(gpt_oss_like(), None, lora=LoraSpec(target_modules="all-linear"), parent_adapter=parent,
                    gc_arg=False, max_seq_length=512, info={}, t0=0.0)
    assert e.value.kwargs["target_modules"] == sorted(DEFAULT_TARGETS) and e.value.kwargs["r"] == 8
    # a dense parent's list is handed on as it is; a regex that names nothing of this base is said so
    assert LoraSpec(target_modules=["v_proj", "q_proj"]).names_on(gpt_oss_like()) == ["v_proj", "q_proj"]
    with pytest.raises(ValueError, match=r"target_modules .*lm_head.* name no module of this base"):
        LoraSpec(target_modules=r"lm_head").names_on(gpt_oss_like())
