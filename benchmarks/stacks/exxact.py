"""scaling, exxact: the Exxact study's recipe, for its scaling efficiency beside ours.

HF Transformers LoRA in bf16 (no quantisation), Llama-3.1-8B, r=16 (alpha 32, dropout 0.05) on q_proj and
v_proj, sequences of 512 tokens, batch 2 per GPU, DistributedDataParallel over NCCL, AdamW. Random token ids
(the study's text does not change the arithmetic). Published: 4,962 tok/s on one RTX PRO 6000 Server
Edition; 96.1 % efficiency on 2x RTX PRO 6000, 96.5 % on 4x RTX PRO 4500 (ANCHORS.md).
"""

from __future__ import annotations

from benchmarks.measure import append_row
from benchmarks.model import vocab_size
from benchmarks.settings import BenchSettings
from benchmarks.stacks.common import Job
from benchmarks.stacks.group_window import peak_reserved_gb, timed

SEQ, BATCH = 512, 2  # per GPU


def run(s: BenchSettings, job: Job) -> None:
    import torch

    from jobs.training.backends.peft_env import hide_torchao_peft_refuses

    hide_torchao_peft_refuses()  # the torchao beside Unsloth is older than PEFT accepts; this stack uses none
    from peft import LoraConfig, get_peft_model
    from torch.nn.parallel import DistributedDataParallel
    from transformers import AutoModelForCausalLM

    from jobs.training.ranks.collectives import init_group
    from jobs.training.ranks.topology import DistributedConfig

    group = init_group(DistributedConfig(timeout_seconds=900, setup_timeout_seconds=3600))
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if cuda else "cpu")
    torch.manual_seed(s.seed)
    model = AutoModelForCausalLM.from_pretrained(str(job.model), dtype=torch.bfloat16 if cuda else torch.float32,
                                                 local_files_only=True, attn_implementation="sdpa").to(device)
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05,
                                             target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    trainable = [p for p in model.parameters() if p.requires_grad]
    net = (DistributedDataParallel(model, device_ids=[device.index] if cuda else None) if group.world > 1
           else model)
    opt = torch.optim.AdamW(trainable, lr=2e-4, fused=cuda)
    gen = torch.Generator().manual_seed(s.seed + group.rank)
    vocab = vocab_size(job.model)

    def step() -> int:
        ids = torch.randint(0, vocab, (BATCH, SEQ), generator=gen).to(device)
        net(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return BATCH * SEQ * group.world

    result = timed(group, step, warmup=s.warmup, max_steps=s.max_steps, seconds=s.seconds)
    if group.is_owner:
        append_row(job.rows, {"stack": "exxact", "gpus": group.world, "profile": f"seq {SEQ} x batch {BATCH}",
                              "label": "Exxact: HF LoRA bf16 r=16 q,v, DDP", **result,
                              "peak_reserved_gb": peak_reserved_gb()})
    group.close()
