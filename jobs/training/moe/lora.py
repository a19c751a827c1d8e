"""Mixture-of-experts bases: LoRA that reaches the experts, and proof every night that it trained them.

Why: the study this project answers fine-tuned GPT-OSS-120B and its adapters never reached the experts
(attention only: 0.01 % of the parameters trainable); a later report against unsloth_zoo (#606) found
expert LoRA tensors receiving gradients in 0 of 192 (native torch backend) or 96 of 192 (Triton). A
wrong expert path fails silently: the loss still falls through attention. So:

- `lora_targets` resolves `[train] target_modules` for a MoE base. "all-linear" means every projection
  of attention (and of dense MLPs) and every expert's projections, never the router. Fused 3-D expert
  weights (transformers 5: GptOssExperts, Qwen3MoeExperts, ...) are reached through PEFT
  `target_parameters` (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`); per-expert nn.Linear
  layers through target_modules. Dense models get their targets back unchanged.
- `ExpertLoraWatch` finds the expert LoRA tensors generically (the factors of a PEFT ParamWrapper, or any
  lora_A / lora_B under `.experts.`), records on the first passes whether each received a non-zero,
  finite gradient, and at the end whether it moved from its value at load; the counts go to the
  manifest (`training.expert_lora`) and a miss fails the night with `ExpertLoraError`.
  lora_A starts random and lora_B at zero, so lora_A's gradient is exactly zero while its lora_B is
  zero (a new adapter's first step): lora_A is judged on the passes where its lora_B was non-zero.
  A fused factor holds every expert (PEFT's ParamWrapper: A is (E*r, in), B is (out, r*E)); its experts
  are counted one by one as slices too, reported but not failed on (an expert may get no token).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from jobs.contract import ExpertLoraReport

log = structlog.get_logger("nightshift.train")

ROUTER_LEAVES = ("router", "gate")  # GPT-OSS `mlp.router`; Qwen-MoE / Mixtral `mlp.gate` (an E x H Linear)
EXPERT_NAME_HINTS = ("gate_proj", "up_proj", "down_proj", "gate_up_proj", "w1", "w2", "w3", "experts")
GRAD_PASSES = 3  # forward/backward passes watched for gradients (a new lora_A's first one is zero)


class ExpertLoraError(RuntimeError):
    """The adapter does not reach, or did not train, the experts of a mixture-of-experts base."""

    def __init__(self, message: str, report: ExpertLoraReport | None = None) -> None:
        super().__init__(message)
        self.report = report


# ---- which weights LoRA adapts ---------------------------------------------------------------------


def num_experts(config: Any) -> int:
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        n = getattr(c, key, None)
        if isinstance(n, int) and n > 1:
            return n
    return 0


def _after_layer_index(name: str) -> str:
    """`model.layers.3.mlp.experts.down_proj` -> `mlp.experts.down_proj` (what PEFT matches as a suffix)."""
    parts = name.split(".")
    idx = max((i for i, p in enumerate(parts) if p.isdigit()), default=-1)
    return ".".join(parts[idx + 1 :])


def fused_expert_parameters(model: Any) -> list[str]:
    """Suffixes of the 3-D (experts, in, out) weights under `.experts.`, in model order, each once."""
    out: list[str] = []
    for name, p in model.named_parameters():
        if p.dim() == 3 and ".experts." in f".{name}" and "lora_" not in name:
            suffix = _after_layer_index(name)
            if suffix not in out:
                out.append(suffix)
    return out


def _linear_leaves(model: Any, n_experts: int) -> tuple[set[str], set[str]]:
    """Leaf names of the Linear layers LoRA may adapt, and of the routers (never adapted)."""
    import torch

    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    leaves: set[str] = set()
    routers: set[str] = set()
    for name, m in model.named_modules():
        if not isinstance(m, torch.nn.Linear) or m is output:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ROUTER_LEAVES and getattr(m, "out_features", None) == n_experts:
            routers.add(leaf)
        else:
            leaves.add(leaf)
    return leaves - routers, routers


def lora_targets(model: Any, target_modules: Sequence[str] | str) -> dict[str, Any]:
    """PEFT LoraConfig keywords (`target_modules`, and `target_parameters` where experts are fused 3-D
    weights) for `[train] target_modules`. Dense models: `{"target_modules": target_modules}` unchanged."""
    n = num_experts(model.config)
    fused = fused_expert_parameters(model)
    if not n and not fused:
        return {"target_modules": target_modules if isinstance(target_modules, str) else list(target_modules)}
    leaves, _routers = _linear_leaves(model, n)
    if target_modules == "all-linear":
        modules, params = sorted(leaves), list(fused)
    else:
        wanted = [target_modules] if isinstance(target_modules, str) else list(target_modules)
        params = [f for f in fused if _wanted_fused(f, wanted)]
        mapped = {w for w in wanted if any(_wanted_fused(f, [w]) for f in params)}
        modules = [w for w in wanted if w in leaves or w not in mapped]
    out: dict[str, Any] = {"target_modules": modules}
    if params:
        _require_target_parameters()
        out["target_parameters"] = params
    return out


def _stem(name: str) -> str:
    return name.removesuffix("_proj")


def _wanted_fused(fused: str, wanted: list[str]) -> bool:
    """`gate_proj` or `up_proj` reach a fused `gate_up_proj`; `down_proj` reaches `down_proj`."""
    leaf = fused.rsplit(".", 1)[-1]
    return any(w in (leaf, fused) or (w.endswith("_proj") and _stem(w) in leaf.split("_")) for w in wanted)


def _require_target_parameters() -> None:
    from peft import LoraConfig

    if "target_parameters" not in getattr(LoraConfig, "__dataclass_fields__", {}):
        import peft

        raise ExpertLoraError(f"peft {peft.__version__} cannot put LoRA on fused expert weights "
                              "(LoraConfig.target_parameters needs peft >= 0.17)")


def wants_experts(target_modules: Sequence[str] | str) -> bool:
    """Did the configuration ask for the experts (all-linear, or an MLP/expert projection by name)?"""
    if target_modules == "all-linear":
        return True
    names = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    return any(h == n or h in n for n in names for h in EXPERT_NAME_HINTS)


def trainable_in_experts(model: Any) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and ".experts." in f".{n}")


def expected_lora_parameters(config: Any, r: int) -> dict[str, int] | None:
    """LoRA parameters for attention (q, k, v, o) and fused experts (gate_up, down) of a GPT-OSS-like
    config: what "all-linear" should give. None for a model without experts."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    e = num_experts(c)
    if not e:
        return None
    h, i, layers = c.hidden_size, getattr(c, "moe_intermediate_size", None) or c.intermediate_size, c.num_hidden_layers
    nh, kv = c.num_attention_heads, getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    hd = getattr(c, "head_dim", None) or h // nh
    attn = r * ((h + nh * hd) + 2 * (h + kv * hd) + (nh * hd + h))
    experts = e * r * (h + 2 * i) + e * r * (i + h)  # ParamWrapper: A (E*r, in), B (out, E*r)
    return {"attention": layers * attn, "experts": layers * experts, "total": layers * (attn + experts)}


def adapt_base(model: Any) -> bool:
    """A base whose attention has sinks (GPT-OSS) gets the packed attention that keeps samples apart
    (transformers' own masks ignore the packing there). True when switched."""
    from jobs.training.moe import packed_attention

    if not packed_attention.has_sinks(model):
        return False
    packed_attention.use_packed_attention(model)
    return True


# ---- did they train ----------------------------------------------------------------------------------


@dataclass
class _Tracked:
    name: str
    param: Any
    experts: int  # > 1: a fused factor holding every expert's slice
    is_b: bool  # lora_B (starts at zero) rather than lora_A
    partner: Any  # lora_A: its lora_B (judged only while that is non-zero)
    at_load: Any = None
    grad: Any = None  # device bool: a non-zero gradient arrived
    finite: Any = None  # device bool: every gradient was finite
    judged: Any = None  # device bool: lora_A's lora_B was non-zero on some watched pass
    slice_grad: Any = None  # device bool[experts]
    hooks: list[Any] = field(default_factory=list)


def expert_lora_tensors(model: Any) -> list[tuple[str, Any, int]]:
    """(name, parameter, experts per tensor) of every trainable LoRA factor that adapts an expert: the
    factors of PEFT ParamWrappers (fused expert weights), then any other lora_A / lora_B under `.experts.`."""
    try:
        from peft.tuners.lora.layer import ParamWrapper
    except ImportError:  # pragma: no cover  (peft < 0.17)
        ParamWrapper = ()  # type: ignore[assignment]
    out: list[tuple[str, Any, int]] = []
    seen: set[int] = set()
    for mname, module in model.named_modules():
        if isinstance(module, ParamWrapper):
            for sub in ("lora_A", "lora_B"):
                for adapter, lin in getattr(module, sub).items():
                    w = lin.weight
                    if w.requires_grad and id(w) not in seen:
                        seen.add(id(w))
                        out.append((f"{mname}.{sub}.{adapter}.weight", w, int(module.num_experts)))
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in seen and ".experts." in f".{name}" and re.search(r"\.lora_[AB]\.", name):
            seen.add(id(p))
            out.append((name, p, 1))
    return out


class ExpertLoraWatch:
    """Watches the expert LoRA tensors of a PEFT model through one training run (see the module doc).

    `strict`: raise ExpertLoraError on the first failed check (the night); else only report (the bench).
    """

    def __init__(self, model: Any, *, grad_passes: int = GRAD_PASSES, strict: bool = True) -> None:
        import torch

        self.model, self.grad_passes, self.strict = model, grad_passes, strict
        self.passes = 0
        self.grads_checked = False
        self.early_report: ExpertLoraReport | None = None
        found = expert_lora_tensors(model)
        by_name = {n: p for n, p, _ in found}
        self.tracked: list[_Tracked] = []
        for name, p, experts in found:
            is_b = ".lora_B." in name
            partner = None if is_b else by_name.get(name.replace(".lora_A.", ".lora_B."))
            t = _Tracked(name, p, experts, is_b, partner, at_load=p.detach().to("cpu", torch.float32, copy=True))
            dev = p.device
            t.grad = torch.zeros((), dtype=torch.bool, device=dev)
            t.finite = torch.ones((), dtype=torch.bool, device=dev)
            t.judged = torch.tensor(is_b or partner is None, device=dev)
            t.slice_grad = torch.zeros(experts, dtype=torch.bool, device=dev)
            t.hooks.append(p.register_post_accumulate_grad_hook(self._grad_hook(t)))
            self.tracked.append(t)
        self._pre = model.register_forward_pre_hook(self._on_forward)

    # hooks: device-side flags only (no host sync) while training runs
    def _grad_hook(self, t: _Tracked) -> Any:
        import torch

        def hook(p: Any) -> None:
            g = p.grad
            if g is None or self.passes > self.grad_passes:
                return
            nz = g.ne(0)
            t.grad |= nz.any()
            t.finite &= torch.isfinite(g).all()
            if t.experts > 1:
                t.slice_grad |= _per_expert(nz, t.experts, t.is_b)
            if t.partner is not None:
                t.judged |= t.partner.detach().ne(0).any()

        return hook

    def _on_forward(self, module: Any, args: Any) -> None:
        import torch

        if not (torch.is_grad_enabled() and module.training):
            return
        self.passes += 1
        if self.passes == self.grad_passes + 1 and not self.grads_checked:  # the watched backwards are done
            self.early_report = self._judge(moved=False)
            self.grads_checked = True
            self._remove_grad_hooks()
            self._maybe_raise(self.early_report)

    def _remove_grad_hooks(self) -> None:
        for t in self.tracked:
            for h in t.hooks:
                h.remove()
            t.hooks.clear()

    def close(self) -> None:
        self._remove_grad_hooks()
        self._pre.remove()

    def finish(self, *, check_moved: bool = True) -> ExpertLoraReport:
        """The night's verdict after training: gradients (if fewer passes than watched ran) and moves."""
        self.close()
        report = self._judge(moved=check_moved)
        self._maybe_raise(report)
        return report

    def _judge(self, *, moved: bool) -> ExpertLoraReport:
        import torch

        problems: list[str] = []
        no_grad = [t.name for t in self.tracked if bool(t.judged) and not bool(t.grad)]
        pending = [t for t in self.tracked if not bool(t.judged)]
        bad = [t.name for t in self.tracked if not bool(t.finite)]
        with_grad = sum(1 for t in self.tracked if bool(t.grad) and bool(t.finite))
        slices = [t for t in self.tracked if t.experts > 1]
        n_moved = slices_moved = None
        still: list[str] = []
        if moved:
            n_moved, slices_moved = 0, 0
            for t in self.tracked:
                now = t.param.detach().to("cpu", torch.float32)
                diff = now.ne(t.at_load)
                if bool(diff.any()):
                    n_moved += 1
                elif bool(t.judged):
                    still.append(t.name)
                if t.experts > 1:
                    slices_moved += int(_per_expert(diff, t.experts, t.is_b).sum())
        if not self.tracked:
            problems.append("the adapter has no LoRA tensor in the experts")
        if no_grad:
            unjudged = f"; {len(pending)} lora_A not judged, their lora_B never left zero" if pending else ""
            problems.append(f"{len(no_grad)} of {len(self.tracked)} expert LoRA tensors received no gradient on the "
                            f"first {min(self.passes, self.grad_passes)} passes (e.g. {', '.join(no_grad[:3])}"
                            f"{unjudged})")
        if bad:
            problems.append(f"{len(bad)} expert LoRA tensors got a NaN or infinite gradient (e.g. {bad[0]})")
        if still:
            problems.append(f"{len(still)} of {len(self.tracked)} expert LoRA tensors did not move during training "
                            f"(e.g. {', '.join(still[:3])})")
        report = ExpertLoraReport(
            tensors=len(self.tracked), parameters=sum(t.param.numel() for t in self.tracked), with_grad=with_grad,
            moved=n_moved, not_judged=len(pending), nonfinite=len(bad), grad_passes=min(self.passes, self.grad_passes),
            expert_slices=sum(t.experts for t in slices),
            slices_with_grad=sum(int(t.slice_grad.sum()) for t in slices), slices_moved=slices_moved,
            problems=problems)
        if slices and report.slices_with_grad < report.expert_slices:
            log.warning("expert_lora_slices_without_gradient", slices=report.expert_slices,
                        with_grad=report.slices_with_grad, note="experts that received no token on the watched passes")
        return report

    def _maybe_raise(self, report: ExpertLoraReport) -> None:
        if report.problems and self.strict:
            self.close()
            raise ExpertLoraError("expert LoRA check failed: " + "; ".join(report.problems) + ". The MoE forward "
                                  "does not train the experts' adapters (cf. unsloth-zoo #606); nothing is published.",
                                  report)


def _per_expert(mask: Any, experts: int, is_b: bool) -> Any:
    """Any True per expert slice of a fused factor: A is (E*r, in) (rows by expert), B is (out, r*E)
    (columns interleaved: column k*E + e belongs to expert e)."""
    if is_b:
        return mask.reshape(mask.shape[0], -1, experts).any(dim=1).any(dim=0)
    return mask.reshape(experts, -1).any(dim=1)


def watch_experts(model: Any, target_modules: Sequence[str] | str, *, strict: bool = True) -> ExpertLoraWatch | None:
    """The night's watch, or None for a dense base. A MoE base whose configuration asked for the experts
    but whose adapter has no LoRA tensor in them fails at once (before the window is spent)."""
    moe = bool(num_experts(getattr(model, "config", None))) or bool(fused_expert_parameters(model))
    if not moe:
        return None
    watch = ExpertLoraWatch(model, strict=strict)
    if not watch.tracked:
        watch.close()
        if wants_experts(target_modules) and strict:
            raise ExpertLoraError("expert LoRA check failed: the base is a mixture of experts and `[train] "
                                  f"target_modules = {target_modules!r}` asks for its experts, but the adapter has no "
                                  "LoRA tensor in them (an adapter continued from an attention-only parent? start a "
                                  "new adapter name, or target attention only); nothing is published.")
        return None
    log.info("expert_lora_watch", tensors=len(watch.tracked),
             parameters=sum(t.param.numel() for t in watch.tracked), grad_passes=watch.grad_passes)
    return watch
