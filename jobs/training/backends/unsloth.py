"""The `unsloth` backend: the base through Unsloth, by `[train] method`:
qlora: 4-bit base through FastLanguageModel, LoRA on top (what follows is about this path);
lora: the same with the base in bf16 (`load_in_4bit=False, load_in_16bit=True`: no quantisation,
no NF4 cache); full: FastModel's full fine-tuning (`full_finetuning=True`: every weight trainable,
bf16 without an fp32 master copy, norms upcast to fp32), packed rows through Unsloth's varlen
attention for the transformers modeling path (`enable_hf_packed_attention`).

Why these pieces:
- The quantised base is cached on disk (`<cache_dir>/bases/<key>/`): night one quantises the
  bf16 checkpoint and saves the NF4 result; later nights load the pre-quantised copy, which is
  ~1/3 of the bytes and skips quantisation (the "fast start" of issue 6).
- torch.compile / Triton / Unsloth's generated sources persist under `<cache_dir>/compile/`
  (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR, UNSLOTH_COMPILE_LOCATION, UNSLOTH_MEGA_CACHE_DIR),
  set before `import unsloth`, so the second night skips the compile work of the first.
- Continuing from the adapter in service: the parent's LoRA shape (rank, alpha, targets) wins
  over the configured one, its weights are loaded into Unsloth's own LoRA layers (so the fast
  LoRA kernels stay in use) and every key must match.
- Mixture-of-experts bases: Unsloth adds PEFT `target_parameters` for fused expert weights
  (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) when gate/up/down are targeted; the
  trainable count is recorded so "experts got no adapters" cannot pass unnoticed.

`unsloth` and `bitsandbytes` are imported inside functions only: this module imports on a CPU box.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from jobs.training.backends.unsloth_lora import LoraSpec, attach_lora, parameter_counts


def setup_caches(cache_dir: Path | str | None) -> dict[str, str]:
    """Point every compile cache into the state directory (call before importing unsloth/torch work).

    Directories are 0700: Unsloth's mega-cache refuses (fails closed on) group/other-writable ones.
    """
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "UNSLOTH_DISABLE_STATISTICS": "1",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        # MoE bases: the only backend whose expert LoRA tensors all got gradients (unsloth-zoo #606)
        "UNSLOTH_MOE_BACKEND": "grouped_mm",
    }
    if cache_dir is not None:
        root = Path(cache_dir) / "compile"
        dirs = {
            "TORCHINDUCTOR_CACHE_DIR": root / "inductor",
            "TRITON_CACHE_DIR": root / "triton",
            "UNSLOTH_COMPILE_LOCATION": root / "unsloth_compiled_cache",
            "UNSLOTH_MEGA_CACHE_DIR": root / "mega",
        }
        for k, d in dirs.items():
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(d, 0o700)
            env[k] = str(d)
        env["UNSLOTH_MEGA_CACHE"] = "1"
        env["TORCH_COMPILE_JOB_ID"] = compile_job_id(root)
    for k, v in env.items():
        if k in ("PYTORCH_CUDA_ALLOC_CONF", "UNSLOTH_MOE_BACKEND", "TORCH_COMPILE_JOB_ID"):
            os.environ.setdefault(k, v)
        else:
            os.environ[k] = v
    config = sys.modules.get("torch.compiler.config")  # torch already imported: it read its environment then
    if "TORCH_COMPILE_JOB_ID" in env and config is not None and getattr(config, "job_id", None) is None:
        config.job_id = os.environ["TORCH_COMPILE_JOB_ID"]
    return env


def compile_job_id(root: Path) -> str:
    """One per cache directory (an operator's own kept): torch's local PGO, which lets a process compile
    dynamic from its first call what earlier ones found dynamic, works only under a job id. Measured with it: a
    night 2's first step still took 3.9-6.1 s and a night 3's 1.25-1.96 s on H100/H200 hosts (RESULTS.md:
    2026-11-26, wake bytecode): not what closes that gap; kept for what its CPU test shows (the next process on
    the same caches compiles a region whose int argument varied once, twice without the id)."""
    return "nightshift-" + hashlib.sha256(str(Path(root).resolve()).encode()).hexdigest()[:12]


def base_cache_key(model_path: Path) -> str:
    """Same source checkpoint (config + weight file names/sizes/mtimes) and same stack -> same key."""
    import importlib.metadata as md

    h = hashlib.sha256()
    h.update((model_path / "config.json").read_bytes())
    for f in sorted(model_path.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{int(st.st_mtime)}".encode())
    for pkg in ("unsloth", "bitsandbytes", "transformers"):
        with contextlib.suppress(md.PackageNotFoundError):
            h.update(f"{pkg}={md.version(pkg)}".encode())
    return h.hexdigest()[:16]


def is_prequantized(model_path: Path) -> bool:
    cfg = json.loads((model_path / "config.json").read_text())
    return bool(cfg.get("quantization_config"))


def cacheable(model_path: Path) -> bool:
    """May the loaded NF4 base be saved for the next night? Not a base that is quantised already, nor one with
    experts: transformers' save keeps no quantisation state for fused 4-bit experts and Unsloth refuses the copy
    ("saved without their bitsandbytes quantization state"): every GPT-OSS QLoRA night after the first failed
    on it (RESULTS.md: 2026-11-28, FP8 / NF4 / bf16 task accuracy (GPT-OSS))."""
    cfg = json.loads((model_path / "config.json").read_text())
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    experts = max(int(c.get(k) or 0) for c in (cfg, text)
                  for k in ("num_local_experts", "num_experts", "n_routed_experts"))
    return not cfg.get("quantization_config") and experts == 0


def refused_marker(cache_path: Path) -> Path:
    return cache_path.with_name(cache_path.name + ".refused")


def refuse_cache(cache_path: Path, why: str) -> None:
    """Remove a cached base Unsloth would not load and remember it, so no later night writes it again."""
    shutil.rmtree(cache_path, ignore_errors=True)
    with contextlib.suppress(OSError):
        refused_marker(cache_path).write_text(json.dumps({"refused": why, "at": time.time()}) + "\n")


def enable_varlen_attention() -> str:
    """Give Unsloth's packed attention a varlen kernel where it would fall back to one SDPA per sample.

    Unsloth 2026.10.9 uses torch's varlen flash path only when `torch.nn.attention.varlen.varlen_attn`
    takes both `window_size` (torch 2.11) and `enable_gqa` (2.12). On torch 2.11 it therefore runs
    packed rows as one SDPA call per sample (forward and backward) plus a gather/scatter of every
    segment: with ~60 alpaca-sized samples per 8k-token step that costs ~40 % of the step. The aten
    flash kernels it would use are in torch 2.11 and take grouped K/V heads natively, so this points
    Unsloth's own lean varlen path (`_LeanFlashVarlen`, the aten flash forward/backward) at them.
    Returns "native" (nothing to do), "patched" or "unavailable".
    """
    import torch
    try:
        from unsloth.utils import attention_dispatch as ad
    except ImportError:  # an Unsloth without the varlen dispatch
        return "unavailable"

    if getattr(ad, "_TORCH_VARLEN_ATTN", None) is not None:
        return "native"
    lean = getattr(ad, "_LeanFlashVarlen", None)
    if (
        lean is None
        or not torch.cuda.is_available()
        or not torch.backends.cuda.is_flash_attention_available()
        or not hasattr(torch.ops.aten, "_flash_attention_forward")
    ):
        return "unavailable"

    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        window = tuple(window_size)
        return lean.apply(q, k, v, cu_q, max_q, window == (-1, 0), scale, window[0], window[1])

    ad._TORCH_VARLEN_ATTN = varlen_attn
    ad._LEAN_VARLEN = True
    ad._varlen_can_use_cudnn = lambda *a, **k: False
    return "patched"


def enable_async_packed_labels() -> str:
    """Move packed rows' segment lengths to the GPU without draining its stream (issue 44).

    Unsloth 2026.10.9 masks each packed sample's boundary label in the CausalLM forward, after the last layer
    (`mask_packed_boundary_labels` -> `_normalize_packed_lengths`), by `lengths.to(cuda)` from the host tensor
    `packed_seq_lengths` (jobs/training/step.py): a pageable, blocking copy, which waits for every queued kernel
    of the forward and then leaves the GPU idle while the host enqueues the loss and the first backward kernels.
    Here a host tensor goes through pinned memory, non-blocking (what Unsloth's own attention metadata does,
    `_pinned_to_device`); the same lengths, so the same labels. Returns "patched", "native" (already done)
    or "unavailable" (another Unsloth: left as shipped).
    """
    import torch

    try:
        from unsloth.utils import packing as up
    except ImportError:  # an Unsloth without the packing module
        return "unavailable"

    orig = getattr(up, "_normalize_packed_lengths", None)
    if orig is None:
        return "unavailable"
    if getattr(orig, "_nightshift", False):
        return "native"

    def normalize(seq_lengths: Any, *, device: Any) -> Any:
        if (isinstance(seq_lengths, torch.Tensor) and seq_lengths.device.type == "cpu"
                and torch.device(device).type == "cuda" and not torch.compiler.is_compiling()
                and os.environ.get("NIGHTSHIFT_PACKED_LABELS_SYNC") != "1"):  # 1: as shipped (the bench's before)
            seq_lengths = seq_lengths.pin_memory().to(device, non_blocking=True)
        return orig(seq_lengths, device=device)

    normalize._nightshift = True  # type: ignore[attr-defined]
    up._normalize_packed_lengths = normalize
    return "patched"


def rank_device_map() -> dict[str, Any]:
    """[distributed] A rank of several loads onto its own card (bound by the group before Unsloth's import);
    one process: Unsloth's own default, as before."""
    from jobs.training.ranks.collectives import launched

    if not launched():
        return {}
    import torch

    return {"device_map": {"": torch.cuda.current_device()}}


def load_unsloth(
    model_path: Path | str,
    *,
    lora: LoraSpec,
    max_seq_length: int = 2048,
    gradient_checkpointing: bool | str = False,
    parent_adapter: Path | str | None = None,
    cache_dir: Path | str | None = None,
    cache_base: bool = True,
    varlen: bool = True,
    method: str = "qlora",
) -> tuple[Any, Any, dict[str, Any]]:
    """(model, tokenizer, info). qlora / lora: a PEFT model in training mode, LoRA trainable; full:
    the whole model trainable, continued from `parent_adapter` (then a model directory) if given.

    gradient_checkpointing: False (fastest, most memory), True or "unsloth" (Unsloth's offloaded
    checkpointing). info: load seconds, cache hit, trainable/total parameter counts, LoRA used.
    """
    t0 = time.perf_counter()
    model_path = Path(model_path)
    setup_caches(cache_dir)
    import torch

    from jobs.training.backends.unsloth_import import import_unsloth

    trl_skipped = import_unsloth()  # patches transformers/peft on import: must come first
    from unsloth import FastLanguageModel


    t_import = time.perf_counter() - t0
    info: dict[str, Any] = {"backend": "unsloth", "import_seconds": round(t_import, 2),
                            "trl_trainer_rewrite": "skipped" if trl_skipped else "as shipped"}
    info["packed_attention"] = enable_varlen_attention() if varlen else "unsloth-as-shipped"
    info["packed_labels"] = enable_async_packed_labels()

    gc_arg: bool | str = "unsloth" if gradient_checkpointing is True else gradient_checkpointing
    if method == "full":
        return _load_full(model_path, parent_adapter, max_seq_length, gc_arg, info, t0)
    quantized = method == "qlora"
    # Unsloth's FastModel sets this flag for a full fine-tuning load and only its own loads clear it; left
    # at "1" by an earlier full load in this process, get_peft_model returns the model without LoRA.
    os.environ["UNSLOTH_ENABLE_FULL_FINETUNING"] = "0"
    if not quantized and is_prequantized(model_path):
        raise ValueError(f'[train] method = "{method}" trains on a 16-bit base, but {model_path} is quantised '
                         "(quantization_config in config.json): point [model] path at the bf16 checkpoint")

    # 1. the base: the cached NF4 copy if there is one (qlora)
    load_from, cache_hit, cache_path = model_path, False, None
    if quantized and cache_dir is not None and cache_base and cacheable(model_path):
        cache_path = Path(cache_dir) / "bases" / base_cache_key(model_path)
        if refused_marker(cache_path).exists():
            cache_path = None  # a copy of this base was written before and Unsloth refused it: never again
        elif (cache_path / "config.json").exists() and (cache_path / "nightshift_base.json").exists():
            load_from, cache_hit = cache_path, True

    def from_pretrained(source: Path) -> tuple[Any, Any]:
        return FastLanguageModel.from_pretrained(
            model_name=str(source),
            load_in_4bit=quantized,
            **({} if quantized else {"load_in_16bit": True}),  # both flags: Unsloth refuses 16-bit with 4-bit on
            **_local_load(max_seq_length, gc_arg),
        )

    t1 = time.perf_counter()
    try:
        model, tokenizer = from_pretrained(load_from)
    except torch.OutOfMemoryError:
        raise  # the card's memory, not the copy: kept for the night the card is free
    except Exception as e:
        if not cache_hit or cache_path is None:
            raise
        # a cache is an optimisation: a copy Unsloth will not load is set aside and the night loads the source
        info["base_cache_refused"] = f"{type(e).__name__}: {e}"[:300]
        refuse_cache(cache_path, info["base_cache_refused"])
        load_from, cache_hit, cache_path = model_path, False, None
        model, tokenizer = from_pretrained(model_path)
    info["base_load_seconds"] = round(time.perf_counter() - t1, 2)
    info.update(base_loaded_from=str(load_from), base_cache_hit=cache_hit, quantized_4bit=quantized)
    # [distributed] one writer per host: the first rank of each host saves the NF4 copy, the others load as is
    if cache_path is not None and not cache_hit and os.environ.get("LOCAL_RANK", "0") == "0":
        t2 = time.perf_counter()
        try:
            save_quantized_base(model, tokenizer, model_path, cache_path)
            info["base_cache_saved_seconds"] = round(time.perf_counter() - t2, 2)
        except Exception as e:  # a cache is an optimisation: never fail the night for it
            info["base_cache_error"] = f"{type(e).__name__}: {e}"[:300]
            shutil.rmtree(cache_path, ignore_errors=True)

    # 2. LoRA: the parent's shape when continuing, else the configured one (a night of several adapters
    # puts each one's LoRA on the base held from the one before: jobs/training/resident.py)
    return attach_lora(model, tokenizer, lora=lora, parent_adapter=parent_adapter, gc_arg=gc_arg,
                       max_seq_length=max_seq_length, info=info, t0=t0)


def _local_load(max_seq_length: int, gc_arg: bool | str) -> dict[str, Any]:
    """What every Unsloth load of a night asks: bf16, local files only (no hub at run time), the tokenizer and
    code as saved, this rank's card."""
    import torch

    return {"max_seq_length": max_seq_length, "dtype": torch.bfloat16, "local_files_only": True,
            "use_gradient_checkpointing": gc_arg, "fix_tokenizer": False, "trust_remote_code": False,
            **rank_device_map()}


def _load_full(model_path: Path, start: Path | str | None, max_seq_length: int, gc_arg: bool | str,
               info: dict[str, Any], t0: float) -> tuple[Any, Any, dict[str, Any]]:
    """Unsloth's full fine-tuning: the model in service (or the base) with every weight trainable."""
    from unsloth import FastModel

    from jobs.training.step import UNSLOTH_FLAG

    source = Path(start) if start is not None else model_path
    t1 = time.perf_counter()
    model, tokenizer = FastModel.from_pretrained(
        model_name=str(source),
        tokenizer_name=str(model_path),  # a checkpoint holds no tokenizer: the base's is the one
        load_in_4bit=False,
        full_finetuning=True,
        **_local_load(max_seq_length, gc_arg),
    )
    info.update(base_load_seconds=round(time.perf_counter() - t1, 2), base_loaded_from=str(source),
                base_cache_hit=False, quantized_4bit=False)
    FastModel.for_training(model, use_gradient_checkpointing=gc_arg)
    try:  # packed rows on the transformers modeling path: varlen flash instead of SDPA over a T x T mask
        from unsloth.utils.hf_packed_attention import enable_hf_packed_attention

        info["packed_attention"] = "hf-varlen" if enable_hf_packed_attention() else "sdpa-block-mask"
    except ImportError:
        info["packed_attention"] = "sdpa-block-mask"
    setattr(model, UNSLOTH_FLAG, True)  # packed_seq_lengths reach the attention
    info.update(parameter_counts(model))
    info.update(gradient_checkpointing=gc_arg, max_seq_length=max_seq_length,
                load_seconds=round(time.perf_counter() - t0, 2))
    if start is not None:
        info["continued_from"] = str(start)
    return model, tokenizer, info


def save_quantized_base(model: Any, tokenizer: Any, source: Path, cache_path: Path) -> None:
    """Write the loaded NF4 base as a pre-quantised checkpoint (temp dir, then rename)."""
    from transformers import PreTrainedModel

    cache_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache_path.parent / f".tmp-{cache_path.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    # transformers' own save (Unsloth may wrap model.save_pretrained with merge/upload logic)
    PreTrainedModel.save_pretrained(model, str(tmp), max_shard_size="5GB")
    tokenizer.save_pretrained(str(tmp))
    for extra in ("nightshift_random.json",):
        if (source / extra).exists():
            shutil.copy2(source / extra, tmp / extra)
    (tmp / "nightshift_base.json").write_text(json.dumps({"source": str(source), "saved_at": time.time()}))
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if cache_path.exists():
        shutil.rmtree(cache_path)
    os.rename(tmp, cache_path)
