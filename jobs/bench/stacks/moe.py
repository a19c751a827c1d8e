"""moe: does LoRA reach a mixture-of-experts model's experts? Trainable parameters against the count
expected for attention + experts, then a few packed steps: do the expert LoRA tensors change?"""

from __future__ import annotations

from typing import Any

from jobs.bench.measure import append_row, peak_gb
from jobs.bench.model import vocab_size
from jobs.bench.settings import BenchSettings
from jobs.bench.stacks.common import Job, load_ours
from jobs.training.synthetic import make_samples


def expected_trainable(arch: str | None, r: int) -> dict[str, int] | None:
    """LoRA parameters of attention and experts for a named MoE architecture (None: not one)."""
    from jobs.training.architectures import make_config

    cfg = make_config(arch) if arch else None
    if cfg is None or not getattr(cfg, "num_local_experts", None):
        return None
    h, i, e, n_layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts, cfg.num_hidden_layers
    hd, nh, kv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    attn = r * ((h + nh * hd) + 2 * (h + kv * hd) + (nh * hd + h))
    # PEFT ParamWrapper LoRA on a 3D (E, in, out) weight: A (E*r, in), B (out, E*r)
    experts = e * r * (h + 2 * i) + e * r * (i + h)
    return {"attention": n_layers * attn, "experts": n_layers * experts, "total": n_layers * (attn + experts)}


def run(s: BenchSettings, job: Job) -> None:
    import torch

    from jobs.training.packing import packed_batches
    from jobs.training.step import make_optimizer, train_step

    model, _tok, info = load_ours(s, job.model, gc=False, cache=False, max_seq=s.max_budget)
    names = sorted(
        {
            n.split(".")[-2] if n.endswith(("lora_A.weight", "lora_B.weight")) else n.rsplit(".", 1)[0]
            for n, p in model.named_parameters()
            if p.requires_grad
        }
    )
    samples = make_samples("alpaca", 20000, vocab=vocab_size(job.model), seed=s.seed)
    opt = make_optimizer(model)
    before = {n: p.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad and ".experts" in n}
    losses: list[float] = []
    err: Any = None
    try:
        for b in list(packed_batches(samples, tokens_per_step=4096))[:4]:
            losses.append(round(train_step(model, b, opt).loss, 4))
    except Exception as ex:
        err = f"{type(ex).__name__}: {ex}"[:400]
    changed = sum(
        1 for n, p in model.named_parameters() if n in before and not torch.equal(before[n], p.detach().float())
    )
    append_row(
        job.rows,
        {
            "mode": "moe",
            "arch": s.arch,
            "info": info,
            "expected_trainable": expected_trainable(s.arch, s.lora_r),
            "trainable_names_sample": [n for n in names if "expert" in n][:10] + names[:5],
            "losses": losses,
            "error": err,
            "expert_lora_tensors": len(before),
            "expert_lora_tensors_updated": changed,
            **peak_gb(),
        },
    )
