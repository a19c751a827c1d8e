"""scaling, ours: the night's own training path on the ranks of a torchrun group (one per GPU).

Loaded as the night loads (jobs.training.load: Unsloth NF4 on CUDA, transformers + PEFT on a CPU), LoRA
r=--lora-r on all linear layers, packed rows at one token budget per card (--budget, else calibration's
probe on each card and the smallest), each global step one row per rank and the gradients reduced once
(jobs.training.ranks.collectives). Rank 0 writes one row per profile: the whole group's real tok/s.
"""

from __future__ import annotations

from benchmarks.measure import append_row
from benchmarks.model import vocab_size
from benchmarks.settings import BenchSettings
from benchmarks.stacks.common import Job
from benchmarks.stacks.group_window import peak_reserved_gb, timed
from jobs.contract import StepShape
from jobs.training.models.synthetic import CAP, make_samples

CPU_BUDGET = 1024  # tokens per step per rank where there is no GPU to probe (the CPU smoke test)


def run(s: BenchSettings, job: Job) -> None:
    import torch

    from jobs.training.config import TrainConfig
    from jobs.training.load import load_for_training
    from jobs.training.packing import packed_batches
    from jobs.training.ranks.collectives import init_group
    from jobs.training.ranks.topology import DistributedConfig
    from jobs.training.step import make_optimizer

    group = init_group(DistributedConfig(timeout_seconds=900, setup_timeout_seconds=3600))
    cuda = torch.cuda.is_available()
    train = TrainConfig(lora_rank=s.lora_r, lora_alpha=s.lora_r, max_seq_length=CAP, batching="packed",
                        gradient_checkpointing=s.ours_ckpt, seed=s.seed)
    shape = StepShape(tokens_per_step=s.max_budget, gradient_checkpointing=s.ours_ckpt, basis="bench scaling")
    loaded = load_for_training(job.model, train, adapter=None, shape=shape, cache_dir=None)
    model, vocab = loaded.model, vocab_size(job.model)
    opt = make_optimizer(model)
    group.start([p for p in model.parameters() if p.requires_grad])
    budget = s.budget or (_probe(s, model, opt, vocab, group) if cuda else CPU_BUDGET)
    for prof in s.profiles:
        need = budget * group.world * (s.warmup + s.max_steps + 2)
        rows = list(packed_batches(make_samples(prof, max(s.data_tokens, need), vocab=vocab, seed=s.seed),
                                   tokens_per_step=budget))
        at = 0

        def step(rows: list = rows) -> int:
            nonlocal at
            chunk = [rows[(at + j) % len(rows)] for j in range(group.world)]
            at += group.world
            return group.step(model, chunk, opt, device=loaded.device).tokens

        if cuda:
            torch.cuda.reset_peak_memory_stats()
        result = timed(group, step, warmup=s.warmup, max_steps=s.max_steps, seconds=s.seconds)
        if group.is_owner:
            append_row(job.rows, {"stack": "ours", "gpus": group.world, "profile": prof, "backend": loaded.backend,
                                  "tokens_per_step_per_gpu": budget, "lora_r": s.lora_r, **result,
                                  "peak_reserved_gb": peak_reserved_gb()})
    group.close()


def _probe(s: BenchSettings, model, opt, vocab: int, group) -> int:
    """Calibration's probe on every card; the budget is the smallest that every card holds."""
    from jobs.training.probe import ProbeSettings, probe_memory

    settings = ProbeSettings(max_vram_gb=s.max_vram_gb, min_tokens=CAP, max_tokens=s.max_budget,
                             probe_tokens=s.probe_tokens, headroom_gb=s.headroom_gb)
    probe = probe_memory(model, make_samples("wiki", 8 * s.probe_tokens, vocab=vocab, seed=s.seed), settings, opt)
    budget = group.smallest(probe.tokens_per_step or 0)
    if not budget:
        raise SystemExit(f"not even {CAP} tokens per step fit under {s.max_vram_gb} GB on every card")
    return budget
