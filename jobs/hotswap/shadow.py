"""The candidate through the server before promotion: what the server answers with its own kernels,
dtype and LoRA path must be what the candidate answered in process.

The candidate's adapter (saved under the state's .tmp- directory) is loaded under a shadow name,
`<prefix>-shadow-<digest>`, which no client asks for and no swap counts as a version; each probe prompt
is sent as token ids for a greedy continuation (EOS not special), compared token for token with the
candidate's own; the shadow is unloaded whatever happened. A server that cannot be asked (down, a
refusal) makes the check say so and pass: a server is never a reason to lose a night; a server
that answers differently fails the gate.
vLLM: POST /v1/completions {"model", "prompt": [ids], "temperature": 0, "ignore_eos", "return_token_ids"}
(choices[0].token_ids). SGLang: POST /generate {"input_ids", "lora_path": name, "sampling_params"}
(output_ids).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jobs.hotswap import preflight
from jobs.hotswap.config import LoraServerTarget, ShadowConfig
from jobs.hotswap.core import AdapterRef, TargetError
from jobs.hotswap.lora_server import Client, lora_path_for
from jobs.hotswap.transport import post_json


@dataclass
class ShadowResult:
    target: str
    name: str
    probes: int = 0
    agreeing: int = 0
    disagreeing: list[int] = field(default_factory=list)  # probe indexes
    error: str | None = None  # the check could not run: why
    unload_error: str | None = None

    @property
    def agreement(self) -> float | None:
        return self.agreeing / self.probes if self.probes and self.error is None else None

    def passed(self, cfg: ShadowConfig) -> bool:
        return self.error is not None or len(self.disagreeing) <= cfg.max_disagreement * self.probes


def shadow_name(adapter: AdapterRef) -> str:
    return f"{adapter.prefix}-shadow-{adapter.digest}"


def _greedy(c: Client, name: str, prompt: list[int], n: int) -> list[int]:
    t = c.t
    if t.kind == "vllm":
        url = t.base_url + "/v1/completions"
        payload: dict[str, Any] = {"model": name, "prompt": prompt, "max_tokens": n, "temperature": 0,
                                   "ignore_eos": True, "return_token_ids": True}
    else:
        url = t.base_url + "/generate"
        payload = {"input_ids": prompt, "lora_path": name,
                   "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}}
    r = post_json(url, payload, **c.kw())
    if not r.ok:
        raise TargetError(f"POST {url}: HTTP {r.status}: {r.message()}", retryable=False)
    body = r.json() if isinstance(r.json(), dict) else {}
    ids = (body.get("choices") or [{}])[0].get("token_ids") if t.kind == "vllm" else body.get("output_ids")
    if not isinstance(ids, list):
        raise TargetError(f"POST {url}: the answer carries no token ids (vLLM >= 0.10.2 returns them)",
                          retryable=False)
    return [int(i) for i in ids]


def check(t: LoraServerTarget, cfg: ShadowConfig, adapter: AdapterRef, prompts: list[list[int]],
          expected: list[list[int]]) -> ShadowResult:
    """Load `adapter` as a shadow on `t`, ask every prompt, compare with `expected`; unload it."""
    name = shadow_name(adapter)
    res = ShadowResult(target=t.name, name=name)
    loaded = False
    try:
        c = Client(t)
        shape = preflight.adapter_shape(adapter.path)
        preflight.check(t, name, shape, c.limits())
        r = c.post("load", {"lora_name": name, "lora_path": lora_path_for(t, adapter)})
        if not r.ok and "already" not in r.message():
            raise TargetError(f"load {name}: HTTP {r.status}: {r.message()}", retryable=False)
        loaded = True
        for i, (prompt, want) in enumerate(zip(prompts, expected, strict=True)):
            c = Client(t)  # a deadline per probe
            got = _greedy(c, name, prompt, cfg.max_new_tokens)
            res.probes += 1
            if got[: len(want)] == want:
                res.agreeing += 1
            else:
                res.disagreeing.append(i)
    except TargetError as e:
        res.error = str(e)
    finally:
        if loaded:
            try:
                res.unload_error = Client(t).unload(name)
            except TargetError as e:
                res.unload_error = str(e)
    return res
