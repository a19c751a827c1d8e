"""The gate's hook for [hotswap.shadow]: the candidate answers the gate's probe prompts in process and
through the inference server (jobs.hotswap.shadow); a disagreement beyond the stated tolerance is one
more failed gate check, `server.greedy_match`. Off by default (no server in the embedded config)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import structlog

from jobs.contract import GateCheck, GateResult, version_name
from jobs.data.batching import IGNORE_INDEX, TokenizedSample
from jobs.hotswap import AdapterRef, shadow
from jobs.night.candidate import Prepared
from jobs.night.context import RunContext

log = structlog.get_logger("nightshift.night")


def prompt_of(sample: TokenizedSample) -> list[int]:
    """The prompt's tokens: everything before the first trained (reply) token."""
    first = next((i for i, lab in enumerate(sample.labels) if lab != IGNORE_INDEX), len(sample.input_ids))
    return sample.input_ids[:first]


def greedy(model: Any, prompts: list[list[int]], n: int, device: str) -> list[list[int]]:
    """Plain argmax, n steps, EOS not special: what the server is asked for (ignore_eos)."""
    import torch

    model.eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            for _ in range(n):
                nxt = model(input_ids=ids).logits[0, -1].argmax()
                ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
            out.append(ids[0, len(p):].tolist())
    return out


def check_through_server(ctx: RunContext, prep: Prepared, version: int, verdict: GateResult) -> None:
    cfg = ctx.cfg.hotswap
    target = cfg.shadow_target()
    if not cfg.shadow.enabled or target is None or not prep.loaded.method.is_adapter:
        return
    probes = [prompt_of(s) for s in [*prep.sets.heldout, *prep.sets.regression]]
    probes = [p for p in probes if p][: cfg.shadow.samples]
    if not probes:
        verdict.checks = [*verdict.checks, _check(None, cfg.shadow, "no probe prompts (no held-out or regression "
                                                                    "samples)")]
        return
    expected = greedy(prep.loaded.model, probes, cfg.shadow.max_new_tokens, prep.loaded.device)
    tmp = ctx.registry.new_tmp_dir(f"shadow-{version}")
    try:
        prep.loaded.model.save_pretrained(str(tmp))
        ref = AdapterRef(version=version, name=version_name(ctx.cfg.model.name, version), path=Path(tmp).resolve(),
                         base_model=str(ctx.model_path))
        res = shadow.check(target, cfg.shadow, ref, probes, expected)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    check = _check(res, cfg.shadow, res.error)
    verdict.checks = [*verdict.checks, check]
    if not check.passed:
        verdict.passed = False
    if res.agreement is not None:
        ctx.summary.metrics["probe_server"] = {"exact_match": res.agreement, "samples": float(res.probes)}
    log.info("gate.shadow", target=res.target, name=res.name, probes=res.probes, agreeing=res.agreeing,
             disagreeing=res.disagreeing, error=res.error, unload_error=res.unload_error, passed=check.passed)


def _check(res: shadow.ShadowResult | None, sh: Any, skipped: str | None) -> GateCheck:
    rule = (f"the server's greedy answers equal the candidate's in process on >= "
            f"{(1 - sh.max_disagreement) * 100:.0f} % of {sh.samples} probes ({sh.max_new_tokens} tokens)")
    after = res.agreement if res is not None else None
    return GateCheck(name="server.greedy_match", against="server", before=1.0 if after is not None else None,
                     after=after, change=None if after is None else after - 1.0,
                     change_pct=None if after is None else (after - 1.0) * 100, rule=rule,
                     passed=res.passed(sh) if res is not None else True,
                     skipped=None if skipped is None else f"not checked: {skipped}")
