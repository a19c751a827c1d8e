# ruff: noqa  (a one-off device script, kept as run)
"""Why install() did not bind the unfused layers of a q,v adapter on Unsloth: diagnostics, then enable_fp8 and a step."""
import json
import sys
from pathlib import Path

import torch

from jobs.training.tinymodel import build_tiny_llama
from jobs.training.unsloth_backend import LoraSpec, load_unsloth

path = build_tiny_llama(Path("/tmp/tinyBB"), sorted(Path("config/sample-inbox").glob("*.json*")))
model, tok, info = load_unsloth(path, lora=LoraSpec(r=16, alpha=32, target_modules=["q_proj", "v_proj"]),
                                method="lora", max_seq_length=512, gradient_checkpointing=False, cache_base=False)
from jobs.training import fp8_unsloth as fu

for name, m in model.named_modules():
    if name.endswith("layers.0.self_attn") or name.endswith("layers.0.mlp"):
        f = getattr(type(m), "forward", None)
        code = getattr(f, "__code__", None)
        print("MODULE", name, type(m).__name__, "forward", getattr(f, "__qualname__", f), getattr(f, "__module__", "?"))
        print("  consts has apply_qkv", code is not None and "apply_qkv" in code.co_consts, "names", code.co_names if code else None)
        print("  wrapped", getattr(f, "__wrapped__", None), "dict keys", [k for k in m.__dict__ if not k.startswith("_")][:20])
        print("  apply_qkv in dict", m.__dict__.get("apply_qkv"), "forward in dict", m.__dict__.get("forward"))
        for r in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"):
            p = getattr(m, r, None)
            if p is not None:
                print("   ", r, type(p).__name__, fu._is_projection(p), fu._has_lora(p) and fu.not_plain(p))
        print("  act", type(getattr(m, "act_fn", None)), "unfused_qkv", fu._unfused_qkv(m), "unfused_swiglu", fu._unfused_swiglu(m),
              "override", fu._mlp_override(m))
sys.stdout.flush()
from jobs.training.fp8_setup import enable_fp8

ids = torch.randint(10, 2000, (256,)).tolist()
out = enable_fp8(model, device="cuda", tokens=ids, activations="random", unsloth=True, storage="fp8")
print("PATCH", json.dumps(out.patch))
print("SELFTEST", json.dumps(out.conversion.get("self_test")), "converted", out.conversion.get("converted"),
      "fallbacks", out.conversion.get("fallbacks"), "error", out.error)
model.train()
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
x = torch.randint(10, 2000, (1, 512), device="cuda")
for i in range(4):
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    print("step", i, float(loss))
from jobs.training.fp8 import STATS

print("STATS", json.dumps(STATS.as_dict()))
