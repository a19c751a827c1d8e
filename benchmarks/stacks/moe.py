"""moe: a mixture-of-experts model (GPT-OSS-120B) built random-initialised in GPU memory, trained through
nightshift's MoE path, side by side with the published recipe on the same model.

Stages, each named in the log and in an error row if it fails (a GPU lease gives one try):
  env        versions, the card, the memory free at start (the step budget's cap with --vram-from-free)
  checks     the flash varlen + sinks attention against per-sample SDPA, and the NF4 grouped expert GEMMs
             against a loop over the dequantised weights (small random data); a failed attention check
             switches that run to the per-sample path (recorded)
  build      the model, layer by layer in NF4 (jobs/training/moe/build.py)
  prepare    LoRA on attention and every expert (PEFT target_parameters), routed through grouped GEMMs
  <profile>  per length profile: probe memory, choose the token budget, timed packed steps (as `ours`),
             then --profile-steps steps under torch.profiler (top kernels, GPU idle share)
  experts    every expert LoRA tensor: a gradient on the first passes, moved since load (the night's check)
  recipe     (--trl-recipe) TRL SFTTrainer, padded batch 32 (117 tok) / 16 (861 tok), gradient checkpointing:
             the published recipe's shape on the same in-memory model (Unsloth loads only directories)
"""

from __future__ import annotations

import contextlib
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.measure import Window, append_row, peak_gb
from benchmarks.settings import BenchSettings
from benchmarks.stacks.common import Job
from benchmarks.stacks.wcommon import sft_window
from jobs.training.models.synthetic import CAP, make_samples

LABEL = "nightshift MoE (NF4 experts, grouped GEMM, packed varlen + sinks)"
RECIPE = "published recipe: TRL SFTTrainer, padded, grad. ckpt"
PEAK_989 = 989e12  # H100/H200 datasheet dense bf16
TARGETS = {"alpaca": 27_600, "wiki": 15_600}  # samples/h: 3x the published H100 figures (9,200 / 5,200)
PUBLISHED_H100 = {"alpaca": 9_200, "wiki": 5_200}
RECIPE_BATCH = {"alpaca": 32, "wiki": 16}


class StageError(RuntimeError):
    pass


@contextlib.contextmanager
def stage(name: str, job: Job, common: dict[str, Any], *, fatal: bool = True) -> Iterator[dict[str, Any]]:
    """Time a stage; on an exception write a row naming it (with the traceback's end) and stop if fatal."""
    t0 = time.perf_counter()
    print(f"moe: {name} ...", flush=True)
    out: dict[str, Any] = {}
    try:
        yield out
    except Exception as e:
        import torch

        tb = traceback.format_exc(limit=6)
        print(f"moe: stage {name} FAILED: {type(e).__name__}: {e}\n{tb}", flush=True)
        append_row(job.rows, {"stack": "moe", "mode": "moe-error", "stage": name, **common,
                              "error": f"{type(e).__name__}: {e}"[:600], "traceback": tb[-3000:],
                              **(peak_gb() if torch.cuda.is_available() else {})})
        if fatal:
            raise StageError(name) from e
    finally:
        print(f"moe: {name} done in {time.perf_counter() - t0:.1f} s", flush=True)


def run(s: BenchSettings, job: Job) -> None:
    common: dict[str, Any] = {"arch": s.arch}
    try:
        _run(s, job, common)
    except StageError as e:
        raise SystemExit(f"moe: stopped at stage {e} (see the error row)") from None


def _run(s: BenchSettings, job: Job, common: dict[str, Any]) -> None:
    import torch

    from jobs.training.models.architectures import make_config, matmul_params
    from jobs.training.moe import packed_attention

    assert s.arch, "BenchSettings requires --arch with --in-memory"
    with stage("env", job, common) as env:
        env.update(_environment())
        free_gb = env["gpu_free_gb"]
        cap = round(free_gb, 1) if s.vram_from_free else s.max_vram_gb
        s = s.model_copy(update={"max_vram_gb": cap})
        matmul = matmul_params(make_config(s.arch))
        common.update(max_vram_gb=cap, matmul_params=matmul)
        print(f"moe: {env}; step memory cap {cap} GB", flush=True)
    with stage("checks", job, common) as checks:
        from jobs.training.moe import experts_nf4

        checks["attention"] = packed_attention.check_flash(torch.device("cuda"), torch.bfloat16)
        checks["experts_nf4"] = experts_nf4.self_check(torch.device("cuda"))
        print(f"moe: self-checks {checks}", flush=True)
        if not checks["experts_nf4"]["ok"]:
            raise RuntimeError(f"NF4 grouped expert GEMMs failed their check: {checks['experts_nf4']}")
    with stage("build", job, common) as built:
        from jobs.training.moe.build import build_random_in_memory

        def progress(i: int, n: int, secs: float) -> None:
            if i % 6 == 0 or i == n - 1:
                print(f"moe: layer {i + 1}/{n} built in {secs:.2f} s, "
                      f"{torch.cuda.memory_allocated() / 1e9:.1f} GB allocated", flush=True)

        model, tok, info = build_random_in_memory(s.arch, device="cuda", seed=s.seed, on_layer=progress)
        built.update(info)
    with stage("prepare", job, common):
        from jobs.training.moe.load import prepare_moe_for_training

        loaded = prepare_moe_for_training(model, tok, r=s.lora_r, alpha=s.lora_r, gradient_checkpointing=s.ours_ckpt,
                                          seed=s.seed, build_info=info)
        model = loaded.model
    with stage("watch", job, common):
        from jobs.training.moe.lora import ExpertLoraWatch

        watch = ExpertLoraWatch(model, strict=False)
    vocab = int(model.config.vocab_size)
    summary_row: dict[str, Any] = {"stack": "moe", "mode": "moe-summary", **common, "env": env, "checks": checks,
                                   "load": loaded.info, "profiles": {}}
    for prof in s.profiles:
        with stage(prof, job, common, fatal=False):
            row = _ours(s, job, model, prof, vocab, matmul, loaded.info)
            summary_row["profiles"][prof] = {k: row.get(k) for k in (
                "real_tok_s", "samples_per_hour", "target_samples_per_hour", "meets_target", "x_published_h100",
                "token_budget", "peak_reserved_gb", "j_per_1k_tok", "mfu_790", "mfu_989", "torch_profile")}
    with stage("experts", job, common, fatal=False):
        report = watch.finish()
        summary_row["expert_lora"] = report.model_dump()
        print(f"moe: expert LoRA {report.model_dump()}", flush=True)
    summary_row["attention_backend"] = packed_attention.backend()
    append_row(job.rows, summary_row)
    if s.trl_recipe:
        for prof in s.profiles:
            with stage(f"recipe {prof}", job, common, fatal=False):
                _recipe(s, job, model, tok, prof, vocab, matmul)


def _environment() -> dict[str, Any]:
    import importlib.metadata as md

    import torch

    free, total = torch.cuda.mem_get_info()
    versions = {}
    for pkg in ("torch", "transformers", "peft", "bitsandbytes", "trl", "accelerate"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    return {"gpu": torch.cuda.get_device_name(0), "gpu_total_gb": round(total / 1e9, 1),
            "gpu_free_gb": round(free / 1e9, 1), "capability": list(torch.cuda.get_device_capability(0)),
            "versions": versions,
            "grouped_mm": hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")}


def _rates(row: dict[str, Any], prof: str, matmul: int) -> dict[str, Any]:
    tps, sph = row.get("real_tok_s"), row.get("samples_per_hour")
    return {
        "mfu_790": tps * 4 * matmul / 790e12 if tps else None,
        "mfu_989": tps * 4 * matmul / PEAK_989 if tps else None,
        "target_samples_per_hour": TARGETS.get(prof),
        "meets_target": bool(sph and sph >= TARGETS.get(prof, float("inf"))),
        "x_published_h100": sph / PUBLISHED_H100[prof] if sph and prof in PUBLISHED_H100 else None,
    }


def _ours(s: BenchSettings, job: Job, model: Any, prof: str, vocab: int, matmul: int,
          info: dict[str, Any]) -> dict[str, Any]:
    import torch

    from benchmarks.profiling import profile_steps
    from benchmarks.stacks.ours import run_ours
    from jobs.training.packing import packed_batches
    from jobs.training.step import make_optimizer

    row = run_ours(model, s, [prof], vocab, label=LABEL, first=prof == s.profiles[0])[0]
    row.pop("first_step_end", None)
    print(f"moe: {prof}: {row.get('real_tok_s') or 0:,.0f} tok/s, {row.get('samples_per_hour') or 0:,.0f} samples/h "
          f"at {row.get('token_budget')} tokens/step, peak reserved {row.get('peak_reserved_gb')} GB"
          f"{', error: ' + row['error'] if row.get('error') else ''}", flush=True)
    row.update(stack="moe", arch=s.arch, matmul_params=matmul, trainable_parameters=info.get("trainable_parameters"),
               trainable_in_experts=info.get("trainable_in_experts"), **_rates(row, prof, matmul))
    if row.get("token_budget") and s.torch_profile:
        try:
            samples = make_samples(prof, row["token_budget"] * (s.profile_steps + 2), vocab=vocab, seed=s.seed + 1)
            batches = list(packed_batches(samples, tokens_per_step=row["token_budget"]))[: s.profile_steps + 1]
            row["torch_profile"] = profile_steps(model, batches, make_optimizer(model), title=f"{s.arch} {prof}",
                                                 path=Path(f"{s.torch_profile}.{prof}.txt"))
            tp = row["torch_profile"]
            top = ", ".join(f"{k['name'][:40]} {100 * k['share']:.0f}%" for k in tp["top_kernels"][:6])
            print(f"moe: profile {prof}: GPU idle share {tp['gpu_idle_share']}, {tp['kernels_per_step']} kernels "
                  f"per step; top: {top}", flush=True)
        except Exception as e:  # the measurement stands without its profile
            row["torch_profile"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        torch.cuda.empty_cache()
    append_row(job.rows, row)
    return row


def _recipe(s: BenchSettings, job: Job, model: Any, tok: Any, prof: str, vocab: int, matmul: int) -> None:
    """TRL SFTTrainer with padded batches and gradient checkpointing on our in-memory model."""
    import torch

    bs = RECIPE_BATCH.get(prof, 16)
    base = model.get_base_model()
    win = Window(warmup=s.warmup, max_steps=s.max_steps, seconds=s.seconds)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        data = _sft(s, model, tok, prof, bs, vocab, win)
        row: dict[str, Any] = {**win.result(data), **peak_gb()}
    except Exception as e:  # an OOM or an API change of the peer stack is a result, not a crash
        row = {"error": f"{type(e).__name__}: {e}"[:400], **peak_gb()}
    finally:
        base.gradient_checkpointing_disable()
        torch.cuda.empty_cache()
    append_row(job.rows, {"stack": "moe-recipe", "label": RECIPE, "profile": prof, "batch": f"{bs} padded",
                          "grad_ckpt": "on", "arch": s.arch, **row, **_rates(row, prof, matmul)})


def _sft(s: BenchSettings, model: Any, tok: Any, prof: str, bs: int, vocab: int, win: Window) -> list[Any]:
    samples = make_samples(prof, max(s.data_tokens, bs * 2048), vocab=vocab, seed=s.seed + 2)
    sft_window(model, tok, samples, win, batch=bs, seed=s.seed, bf16=False, optim="adamw_torch_fused",
               max_length=CAP, packing=False, padding_free=False)
    return samples
