"""The benchmark: QLoRA throughput measured side by side, on this GPU, run from a checkout. Not part of the
product: nothing under daemon/ or jobs/ imports this package, and the wheel leaves it out (pyproject.toml).

    python -m benchmarks bench --arch llama3.1-8b --out /tmp/bench   (all stacks, both profiles)
    python -m benchmarks faststart --arch llama3.1-8b --state-dir S    (time to first step, night 1 / night 2)
    python -m benchmarks budget --arch llama3.1-8b                     (plan from calibration, then train)
    python -m benchmarks moe --arch gpt-oss-small                      (LoRA reaches the experts?)
    python -m benchmarks bench --arch llama3.1-8b --stacks ours --compute fp8,bf16
                                       (our path with the frozen base on FP8 beside bf16: issue 16)
    python -m benchmarks moe --arch gpt-oss-120b --vram-from-free      (MoE built in GPU memory, expert check)
    python -m benchmarks workloads --quick --out DIR                   (the published runs, each beside ours:
                                                                        workloads.py, stacks/w_*.py)

(`nightshift calibrate` measures and records our path for the planner: jobs/night/calibrate.py.)

Stacks (benchmarks/stacks/, each in its own worker process: Unsloth patches transformers at import,
and a fresh process frees every byte of VRAM between stacks):
  baseline   HF transformers + PEFT + bitsandbytes NF4, gradient checkpointing on, batch 4 padded
  unsloth    Unsloth defaults (its offloaded checkpointing), batch 4 padded
  trl        Unsloth + TRL SFTTrainer: padding_free with a large batch, and packing=True
  ours       nightshift: packed rows to a token budget chosen from measured memory under
             max_vram_gb, varlen attention (no cross-sample attention), checkpointing off when it fits;
             one worker per --compute (bf16; fp8: frozen base on FP8 after the numerics check, whose
             row "numerics" and fp8-layers-<compute>.json it writes, its base an e4m3 copy; fp8-nf4: the
             base kept in NF4; fp8t: the e4m3 copy and a kept transposed copy)
  moe        (--in-memory) a MoE (GPT-OSS-120B) built random-initialised in GPU memory, NF4, through
             nightshift's MoE path: LoRA on attention + every expert, packed, expert LoRA check, profile
  ours_lora  the same with `[train] method = "lora"` (the base in bf16)

The parent (cli.py) holds no GPU memory while workers run: it never imports torch; the model is
built random-initialised (or read) in a child of its own (model.py). Workers get the settings
(settings.BenchSettings) as JSON on stdin and append their rows to a JSON-lines file.

Data: random token ids, lengths log-normal with mean 117 ("alpaca") or 861 ("wiki"), capped at
2048 (jobs.training.models.synthetic). Each row: warm-up steps, then timed steps (up to --max-steps or
--seconds) (measure.py). real tok/s counts non-padding tokens. MFU = real tok/s x 4 x matmul
params / --peak-flops (report.py); the table shows each row against its own format's peaks.
Power and energy: NVML (jobs.gpu.telemetry.GpuSampler) over the timed window.
"""
