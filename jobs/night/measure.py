"""What the gate reads: the night's evaluation sets, measured under every model it compares.

Sets: `heldout` (tonight's new samples kept out of training, topped up to `[eval] heldout_pool` with
the most recent earlier nights' held-out samples: one night's 5 % is often a handful, and a decision
on 8 samples is noise), `regression` (the held-out slices of earlier promoted nights from the ledger,
round-robin under `max_eval_samples`: the user's own data only), `retention` (samples the reference
version was trained on, not tonight's: what the best version learned; a few held-out samples a night
cannot show a 5-point loss, 256 trained ones can -- benchmarks/chain.py), `tonight` (tonight's new training
samples: whether the night learned something the service did not know) and `canary` (the operator's fixed
file, `[eval] canary_set`, measured apart so that records the user never gave cannot outweigh the
user's). A set with fewer than `min_eval_samples` samples is not evaluated, and says why. Every
stage's per-sample scores are kept for the gate's paired test, and the candidate's KL divergence from
the adapter in service on tonight's samples is measured with them (jobs/night/drift.py).

Models (the stage names of the metrics "<data>_<stage>"): `before` (the adapter in service; a new
adapter, whose lora_B weights are all zero, takes the base's figures), `reference` (the best promoted
version so far), `after` (the candidate) and `base` (the adapter disabled; the reference while none is
promoted). All four are measured after training, so nothing but the first step waits on the wake: the
base because training does not change it, the adapter in service and the reference by loading their
weights into the trained adapter for the pass (the candidate's put back). Before this, an 8B's night 2
spent 6.2 s scoring tonight's held-out samples (in service, then the base) before its first step on an
H200 (RESULTS.md: 2026-11-26, wake restart). What the measurement before training decided (the
reference, a new adapter, what is owed) is kept next to the checkpoints, so a resumed night is judged
against what it started from. Full fine-tuning has no adapter to swap: its model in service is scored
before training. Per-sample scores of the base and of published versions are kept across nights
(jobs/night/scores.py): a model is scored once on a sample.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import structlog

from jobs.data.batching import TokenizedSample
from jobs.data.render import tokenize_record
from jobs.learning import evaluate
from jobs.night import drift
from jobs.night.context import RunContext
from jobs.night.scores import BASE_MODEL, LoadIdentity, ScoreCache, version_model
from jobs.store import learning
from jobs.store.files import write_private_json
from jobs.store.paths import StatePaths
from jobs.store.registry import parse_version

log = structlog.get_logger("nightshift.night")
Measured = dict[str, dict[str, float] | None]
FILE_SLICE = "file"


@dataclass
class EvalSets:
    heldout: list[TokenizedSample]
    regression: list[TokenizedSample]
    cache: ScoreCache  # kept scores of the base and the published versions
    slices: dict[int, str] = field(default_factory=dict)  # regression sample id -> "<night>/<source>" | "file"
    reference: int | None = None  # the reference version (None: the base model)
    reference_path: Path | None = None
    service: int | None = None  # the version in service the candidate was trained from
    service_path: Path | None = None
    after: dict[int, evaluate.SampleScore] = field(default_factory=dict)  # the candidate's, kept once published
    before_is_base: bool = False  # a new adapter (every lora_B zero): it scores as the base, measured after
    owed: list[str] = field(default_factory=list)  # stages measured after training by swapping weights in
    canary: list[TokenizedSample] = field(default_factory=list)  # the operator's file
    retention: list[TokenizedSample] = field(default_factory=list)  # what the reference was trained on
    tonight: list[TokenizedSample] = field(default_factory=list)  # tonight's new training samples: what it learned
    kl_set: list[TokenizedSample] = field(default_factory=list)  # tonight's samples the KL is measured on
    per_sample: dict[str, dict[int, evaluate.SampleScore]] = field(default_factory=dict)  # "<data>_<stage>"
    view: drift.View = field(default_factory=dict)  # the candidate's distributions on kl_set


def score_cache(ctx: RunContext, loaded: Any, compute: str) -> ScoreCache:
    t = ctx.cfg.train
    ident = LoadIdentity(base=str(ctx.model_path), method=str(loaded.method), compute=compute, backend=loaded.backend,
                         max_seq_length=t.max_seq_length, special_tokens=str(t.special_tokens))
    return ScoreCache(StatePaths(ctx.state).score_cache, ident)


def build_sets(ctx: RunContext, tokenizer: Any, heldout_ids: list[int], parent: int | None,
               cache: ScoreCache, new_samples: list[TokenizedSample] | None = None) -> EvalSets:
    """`new_samples`: tonight's new training samples (the KL is measured on them after the held-out)."""
    started = time.monotonic()
    cfg, ledger = ctx.cfg, ctx.ledger
    tk = {"max_seq_length": cfg.train.max_seq_length, "overlong": "truncate",
          "special_tokens": cfg.train.special_tokens}
    cap = cfg.eval.max_eval_samples
    tonight = heldout_ids[:cap]
    pooled = learning.recent_heldout(ledger, min(cap, cfg.eval.heldout_pool) - len(tonight), exclude=set(tonight))
    heldout = [tokenize_record(tokenizer, r.id, r.record, **tk) for r in ledger.samples_by_id(tonight + pooled)]
    picked = learning.regression_ids(ledger, cap)
    slices = dict(picked)
    regression = [tokenize_record(tokenizer, r.id, r.record, **tk)
                  for r in ledger.samples_by_id([sid for sid, _ in picked])]
    canary = (evaluate.load_regression_set(cfg.eval.canary_set, tokenizer, limit=cap,
                                           max_seq_length=cfg.train.max_seq_length) if cfg.eval.canary_set else [])
    ref = learning.reference_version(ledger)
    kept = learning.retention_ids(ledger, cfg.eval.retention_samples, upto=ref,
                                  exclude={sid for sid, _ in ledger.run_samples(ctx.run_id)})
    slices.update(kept)
    retention = [tokenize_record(tokenizer, r.id, r.record, **tk) for r in ledger.samples_by_id([i for i, _ in kept])]
    own = [s for s in heldout if s.sample_id in set(tonight)]
    kl_set = (own + list(new_samples or []))[: cfg.eval.kl_samples]
    ref_path = ctx.registry.path_of(cfg.model.name, ref) if ref is not None else None
    if ref_path is not None and not (ref_path / "adapter_model.safetensors").is_file():
        log.warning("reference_not_on_disk", version=ref, note="the base model serves as the reference")
        ref, ref_path = None, None
    service_path = ctx.registry.path_of(cfg.model.name, parent) if parent is not None else None
    log.info("eval_sets", heldout=len(heldout), pooled=len(pooled), regression=len(regression), canary=len(canary),
             retention=len(retention), seconds=round(time.monotonic() - started, 2))
    return EvalSets(heldout, regression, cache, slices, ref, ref_path, parent, service_path, canary=canary,
                    retention=retention, tonight=list(new_samples or [])[: cfg.eval.learning_samples], kl_set=kl_set)


def measure_all(ctx: RunContext, loaded: Any, sets: EvalSets,
                when: Literal["before", "after"]) -> tuple[Measured, dict[str, dict[str, Any]]]:
    """The metrics of `when`'s models and the regression slices' figures ({slice: {stage: metrics}})."""
    saved = kept_before(ctx) if when == "before" else None
    if saved is not None:
        ctx.summary.not_evaluated.update(saved.get("not_evaluated", {}))
        sets.reference = saved.get("reference")
        sets.before_is_base = bool(saved.get("before_is_base"))
        sets.owed = [str(x) for x in saved.get("owed", [])]  # an older night's file: everything was measured
        return saved["metrics"], saved["slices"]
    sized = _sized(ctx, {"heldout": sets.heldout, "regression": sets.regression, "canary": sets.canary,
                         "retention": sets.retention, "tonight": sets.tonight})
    model = loaded.model
    measured: Measured = {}
    slices: dict[str, dict[str, Any]] = {}

    def run(stage: str, model_key: str | None = None) -> None:
        for data, samples in sized.items():
            scores = sets.cache.scored(model_key, samples, lambda ss: _scores(ctx, loaded, ss))
            if stage == "after":
                sets.after.update(scores)
            sets.per_sample[f"{data}_{stage}"] = scores
            measured[f"{data}_{stage}"] = evaluate.summarize(scores.values()) if samples else None
            if data == "regression":
                for name, m in _by_slice(scores, sets.slices).items():
                    slices.setdefault(name, {})[stage] = m

    if when == "after":
        run("after")
        if hasattr(model, "disable_adapter"):
            kl = _Kl(ctx, loaded, sets)
            with model.disable_adapter():
                run("base", BASE_MODEL)
                if sets.before_is_base:
                    kl.measure()
            if "before" in sets.owed:
                _run_swapped(ctx, model, sets.service_path, "before",
                             lambda: (run("before", version_model(sets.service)), kl.measure()), sized)
            kl.close()
            if "reference" in sets.owed and sets.reference is not None and not _run_swapped(
                    ctx, model, sets.reference_path, "reference",
                    lambda: run("reference", version_model(sets.reference)), None):
                log.warning("reference_incompatible", version=sets.reference, note="the base model serves instead")
                sets.reference, sets.reference_path = None, None
            _fill_from_others(measured, slices, sets, sized)
        return measured, slices
    if not hasattr(model, "disable_adapter"):  # full fine-tuning: the model is whole, no adapter to switch off
        run("before", version_model(sets.service) if sets.service is not None else None)
        why = "full fine-tuning: the base and the reference are whole models, not measured in the night"
        for data in sized:
            measured[f"{data}_base"] = measured[f"{data}_reference"] = None
            ctx.summary.not_evaluated.setdefault(f"{data}_base", why)
            ctx.summary.not_evaluated.setdefault(f"{data}_reference", why)
        sets.reference, sets.reference_path = None, None
        _keep_before(ctx, {"metrics": measured, "slices": slices, "reference": None,
                           "not_evaluated": ctx.summary.not_evaluated})
        return measured, slices
    if _new_adapter(model):
        sets.before_is_base = True  # adds nothing to the base yet: its figures are the base's
    elif sets.service_path is not None:
        sets.owed.append("before")  # the weights it starts from are the service's file: swapped back in after
    else:  # an adapter that is neither new nor a published version's (not one a night loads): measured now
        run("before")
    if sets.reference is not None and sets.reference != sets.service:
        sets.owed.append("reference")
    _keep_before(ctx, {"metrics": measured, "slices": slices, "reference": sets.reference,
                       "before_is_base": sets.before_is_base, "owed": sets.owed,
                       "not_evaluated": ctx.summary.not_evaluated})
    return measured, slices


class _Kl:
    """The candidate's view taken now (its weights in the model); measured against the adapter in service
    in whichever pass has the service's weights in (the base's, for a new adapter)."""

    def __init__(self, ctx: RunContext, loaded: Any, sets: EvalSets) -> None:
        self.ctx, self.loaded, self.sets, self.done = ctx, loaded, sets, False
        self.kw = {"pad_id": loaded.tokenizer.pad_token_id, "device": loaded.device,
                   "max_tokens_per_batch": ctx.cfg.eval.max_tokens_per_batch}
        sets.view = drift.candidate_view(loaded.model, sets.kl_set, **self.kw) if sets.kl_set else {}

    def measure(self) -> None:
        d = drift.kl_from_view(self.loaded.model, self.sets.kl_set, self.sets.view, **self.kw)
        self.done = d is not None
        if d is not None:
            self.ctx.summary.kl_from_service = round(d.kl, 6)
            log.info("drift", kl=round(d.kl, 5), samples=d.samples, tokens=d.tokens)

    def close(self) -> None:
        self.sets.view = {}
        if not self.done:
            self.ctx.summary.not_evaluated.setdefault("kl", "no samples tonight, or the adapter in service was not "
                                                            "measured after training" if self.sets.kl_set else
                                                            "no samples tonight ([eval] kl_samples)")


def _run_swapped(ctx: RunContext, model: Any, path: Path | None, stage: str, run: Any,
                 sized: dict[str, list[TokenizedSample]] | None) -> bool:
    """`run` with another version's adapter weights in the model, the candidate's put back after (whatever
    happens: they are what the night publishes). False where they could not be loaded (another shape, a file
    gone or damaged since the night loaded it: a measurement missing, never the night failed; `sized`: say
    so for each set)."""
    from peft import get_peft_model_state_dict

    candidate = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    try:
        loaded = _load_into(model, path, candidate)
    except Exception as e:
        _restore(model, candidate)
        log.warning("adapter_not_swapped_in", stage=stage, path=str(path), error=f"{type(e).__name__}: {e}"[:300])
        loaded = False
    if not loaded:
        for data in sized or {}:
            ctx.summary.not_evaluated.setdefault(f"{data}_{stage}", f"the {stage} adapter's weights could not be "
                                                                    f"loaded into the model ({path})")
        return False
    try:
        run()
    finally:
        _restore(model, candidate)
    return True


def _fill_from_others(measured: Measured, slices: dict[str, dict[str, Any]], sets: EvalSets,
                      sized: dict[str, list[TokenizedSample]]) -> None:
    """The stages that are another's figures: the base as the reference while none is promoted, the base as
    a new adapter's `before`, the service as the reference when it is the best promoted."""
    ps = sets.per_sample
    for data in sized:
        if sets.before_is_base:
            measured[f"{data}_before"] = measured[f"{data}_base"]
            ps[f"{data}_before"] = ps.get(f"{data}_base", {})
        if sets.reference is None:
            measured[f"{data}_reference"] = measured[f"{data}_base"]
            ps[f"{data}_reference"] = ps.get(f"{data}_base", {})
        elif sets.reference == sets.service and f"{data}_before" in measured:  # else kept from before training
            measured[f"{data}_reference"] = measured[f"{data}_before"]
            ps[f"{data}_reference"] = ps.get(f"{data}_before", {})
    if sets.before_is_base:
        for stages in slices.values():
            stages["before"] = stages.get("base")


def _new_adapter(model: Any) -> bool:
    """A LoRA as initialised (every lora_B zero, checked here) adds zero to every projection, so a night's
    first attempt without a version in service takes the base's scores for it. On the CPU's PEFT path the
    scores are the base's exactly (tests/night/test_scores.py); Unsloth's fused LoRA kernels may round
    their base product differently from the adapter-disabled path (not measured)."""
    bs = [p for n, p in model.named_parameters() if "lora_B" in n]
    return bool(bs) and not any(bool(p.detach().any()) for p in bs)


def keep_candidate_scores(ctx: RunContext, sets: EvalSets, version: int) -> None:
    """The promoted candidate's scores, as the version it now is: tomorrow's "before" and "reference"."""
    samples = [s for s in sets.heldout + sets.regression + sets.canary + sets.retention if s.sample_id in sets.after]
    sets.cache.add(version_model(version), samples, sets.after)
    on_disk = {v for p in ctx.registry.adapters.iterdir() if (v := parse_version(p.name)) is not None}
    sets.cache.forget_versions_except(on_disk)


def kept_before(ctx: RunContext) -> dict[str, Any] | None:
    """What an earlier attempt of this run measured before training (None: nothing, or unreadable:
    then it is measured again and no checkpoint is continued)."""
    try:
        saved = json.loads((ctx.checkpoints / "before.json").read_text())
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) and isinstance(saved.get("metrics"), dict) else None


def _keep_before(ctx: RunContext, saved: dict[str, Any]) -> None:
    """Written atomically and private, like the checkpoints beside it."""
    write_private_json(ctx.checkpoints / "before.json", saved)


def _sized(ctx: RunContext, sets: dict[str, list[TokenizedSample]]) -> dict[str, list[TokenizedSample]]:
    """Sets with too few samples are not evaluated (the gate skips them, or fails a required rule)."""
    least = ctx.cfg.eval.min_eval_samples
    out = {}
    for data, samples in sets.items():
        if len(samples) < least:
            ctx.summary.not_evaluated[data] = f"{len(samples)} {data} samples < min_eval_samples {least}"
            out[data] = []
        else:
            out[data] = samples
    return out


def _scores(ctx: RunContext, loaded: Any, samples: list[TokenizedSample]) -> dict[int, evaluate.SampleScore]:
    return evaluate.score_samples(loaded.model, samples, pad_id=loaded.tokenizer.pad_token_id,
                                  device=loaded.device, max_tokens_per_batch=ctx.cfg.eval.max_tokens_per_batch)


def _by_slice(scores: dict[int, evaluate.SampleScore], slices: dict[int, str]) -> dict[str, Any]:
    groups: dict[str, list[evaluate.SampleScore]] = {}
    for sid, sc in scores.items():
        groups.setdefault(slices.get(sid, FILE_SLICE), []).append(sc)
    return {name: evaluate.summarize(g) for name, g in sorted(groups.items())}


def _load_into(model: Any, path: Path | None, current: dict[str, Any]) -> bool:
    """Another version's adapter weights into the model's adapter; False (the model untouched) where there
    is none or its shapes differ from `current`'s."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    if path is None:
        return False
    other = load_file(str(path / "adapter_model.safetensors"))
    if set(other) != set(current) or any(other[k].shape != current[k].shape for k in other):
        return False
    set_peft_model_state_dict(model, other)
    return True


def _restore(model: Any, weights: dict[str, Any]) -> None:
    from peft import set_peft_model_state_dict

    set_peft_model_state_dict(model, weights)
