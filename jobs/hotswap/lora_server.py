"""Load a version into vLLM or SGLang at runtime, confirm it is served, unload our old ones.

What the servers document (checked against their docs and released wheels, not guessed: vLLM
0.11.0 to 0.33.0, SGLang 0.4.9 to 0.5.23):

vLLM (docs/features/lora.md, "Dynamically serving LoRA Adapters"; server code
vllm/entrypoints/openai/serving_models.py):
- needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora; without the variable the
  routes are not registered (a 404 here: a permanent, configuration error).
- POST /v1/load_lora_adapter {"lora_name", "lora_path"} -> 200 "Success: LoRA adapter ...
  added successfully."; 400 "The lora adapter '<name>' has already been loaded." when the
  name is taken; 404 NotFoundError when no adapter is found at lora_path.
- POST /v1/unload_lora_adapter {"lora_name"} -> 200; 404 "... cannot be found." if unknown.
- GET /v1/models lists the base model(s) and every loaded adapter: data[].id = lora_name,
  data[].root = its path, data[].parent = the base model.
- Reloading under the same name needs "load_inplace": true (newer vLLM); we never do that:
  every version has its own name, so a client can never get stale cached weights.
- With --api-key, these /v1 routes need "Authorization: Bearer <key>".

SGLang (docs/advanced_features/lora.ipynb "Dynamic LoRA loading"; server code
python/sglang/srt/entrypoints/http_server.py):
- POST /load_lora_adapter and /unload_lora_adapter with the same {"lora_name", "lora_path"}
  / {"lora_name"} bodies; answer LoRAUpdateOutput {"success", "error_message",
  "loaded_adapters"}, HTTP 200 on success and 400 otherwise (a duplicate name included).
- The load (and unload) answer's `loaded_adapters` is every adapter held after the operation,
  name -> path (0.4.9 to 0.5.23): that confirms a load. GET /v1/models lists adapters (id =
  lora_name, root = lora_path, parent = the served model) only from 0.5.4.post2 (sglang PR
  #12229); 0.4.9 to 0.5.4.post1 list the base model alone, so /v1/models is asked only when the
  answer carries no `loaded_adapters`, and believed only when it lists adapters at all.
- The docs advise starting it with --max-lora-rank and --lora-target-modules when adapters
  are loaded at runtime (their shape must fit what the server reserved).

Idempotent re-send (`nightshift hotswap`, a retry after a lost answer): a 400/409 on load
counts as success when the name is then listed by /v1/models.
"""

from __future__ import annotations

import time
from typing import Any

from jobs.hotswap.config import LoraServerTarget, SecretError
from jobs.hotswap.core import (
    AdapterRef,
    Clock,
    HotswapOutcome,
    Sleep,
    TargetError,
    parse_version_name,
    with_retries,
)
from jobs.hotswap.transport import Response, post_json, request, retryable_status, tls_context

ROUTES = {
    "vllm": {"load": "/v1/load_lora_adapter", "unload": "/v1/unload_lora_adapter", "list": "/v1/models"},
    "sglang": {"load": "/load_lora_adapter", "unload": "/unload_lora_adapter", "list": "/v1/models"},
}


class _Client:
    def __init__(self, t: LoraServerTarget) -> None:
        self.t = t
        self.routes = ROUTES[t.kind]
        self.ctx = tls_context(t.verify_tls, t.ca_bundle)
        try:
            key = t.api_key()
        except SecretError as e:
            raise TargetError(str(e), retryable=False) from e
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    def post(self, route: str, payload: dict[str, Any]) -> Response:
        return post_json(
            self.t.base_url + self.routes[route],
            payload,
            headers=self.headers,
            timeout_s=self.t.timeout_s,
            ctx=self.ctx,
        )

    def cards(self) -> list[dict[str, Any]]:
        url = self.t.base_url + self.routes["list"]
        r = request("GET", url, headers=self.headers, timeout_s=self.t.timeout_s, ctx=self.ctx)
        if not r.ok:
            raise TargetError(f"GET {url}: HTTP {r.status}: {r.message()}", retryable=retryable_status(r.status))
        data = r.json()
        items = data.get("data") if isinstance(data, dict) else None
        if not isinstance(items, list):
            raise TargetError(f"GET {url}: no data[] list in the answer", retryable=False)
        return [m for m in items if isinstance(m, dict) and "id" in m]

    def models(self) -> dict[str, str | None]:
        """Every id served (base models and adapters) -> its `root` (an adapter's path)."""
        return {str(m["id"]): m.get("root") for m in self.cards()}

    def served(self, answer: Any = None) -> tuple[dict[str, str | None] | None, str]:
        """The adapters the server holds, and who said so. SGLang: the `loaded_adapters` of a load or
        unload answer (name -> path, every SGLang since 0.4.9); else /v1/models, but only where it
        lists adapters (SGLang 0.4.9 to 0.5.4.post1 lists the base model alone: None, "unknown").
        vLLM: /v1/models, which lists every loaded adapter."""
        if self.t.kind == "sglang":
            loaded = answer.get("loaded_adapters") if isinstance(answer, dict) else None
            if isinstance(loaded, dict):
                return {str(k): (v if isinstance(v, str) else None) for k, v in loaded.items()}, "load response"
            cards = self.cards()
            if not any(m.get("parent") for m in cards):
                return None, "unknown: /v1/models lists no adapters on this SGLang build"
            return {str(m["id"]): m.get("root") for m in cards}, self.routes["list"]
        return self.models(), self.routes["list"]


def ours(names: list[str] | dict[str, Any], prefix: str) -> list[str]:
    """Our versioned names among those served, oldest version first."""
    found = [(p[1], n) for n in names if (p := parse_version_name(n)) and p[0] == prefix]
    return [n for _, n in sorted(found)]


def plan_unloads(loaded: list[str], just_loaded: str, keep_loaded: int) -> list[str]:
    """Which of our loaded names to unload, oldest first: we keep the one just loaded and the
    keep_loaded - 1 newest others (after a rollback these are the versions clients were
    using a moment ago). The one just loaded is never unloaded."""
    others = sorted((n for n in loaded if n != just_loaded), key=_version)
    keep = set(others[max(0, len(others) - (keep_loaded - 1)) :]) if keep_loaded > 1 else set()
    return [n for n in others if n not in keep]


def _version(name: str) -> int:
    parsed = parse_version_name(name)
    return parsed[1] if parsed else -1


def loaded_versions(t: LoraServerTarget, prefix: str) -> list[str]:
    """The 'kept loaded' set: our versions that the server lists now, oldest first (an SGLang that
    lists no adapters in /v1/models cannot say without a load: [])."""
    served, _ = _Client(t).served()
    return ours(served or {}, prefix)


def lora_path_for(t: LoraServerTarget, adapter: AdapterRef) -> str:
    if t.remote_adapters_dir:
        return f"{t.remote_adapters_dir.rstrip('/')}/{adapter.path.name}"
    return str(adapter.path)


def swap(
    t: LoraServerTarget,
    adapter: AdapterRef,
    *,
    sleep: Sleep,
    clock: Clock = time.monotonic,
    log: Any,
) -> HotswapOutcome:
    """Load `adapter` under its versioned name, confirm it is listed, unload our extra versions."""
    name, path = adapter.name, lora_path_for(t, adapter)
    if not t.verify_tls and t.base_url.startswith("https:"):
        log.warning("hotswap.tls_unverified", target=t.name, url=t.base_url)

    def attempt(_: int) -> dict[str, Any]:
        c = _Client(t)
        detail: dict[str, Any] = {"lora_name": name, "lora_path": path, "already_loaded": False}
        r = c.post("load", {"lora_name": name, "lora_path": path})
        body = r.json()
        if r.ok and isinstance(body, dict) and body.get("success") is False:  # SGLang says no
            raise TargetError(f"load {name}: {r.message()}", retryable=False)
        served, said_by = c.served(body)
        if not r.ok:
            # idempotent re-send: the server has it (SGLang may say so only in its own words)
            held = name in (served or {}) or (t.kind == "sglang" and "already loaded" in r.message())
            if r.status in (400, 409) and held:
                detail["already_loaded"] = True
            else:
                raise TargetError(
                    f"load {name}: HTTP {r.status}: {r.message()}",
                    retryable=retryable_status(r.status),
                    detail={"status": r.status},
                )
        if detail["already_loaded"] and name not in (served or {}):
            served = {**(served or {}), name: None}
            said_by = "the server's 'already loaded' answer"
        if served is None:
            raise TargetError(f"{name}: the load answer lists no adapters and {c.routes['list']} lists none on "
                              "this server: cannot confirm the load", retryable=False)
        if name not in served:
            raise TargetError(f"{name} was accepted but is not listed by the {said_by}", retryable=True)
        detail["confirmed_by"] = said_by
        root = served[name]
        if root and root != path:
            detail["warning"] = f"{name} is served from {root}, not {path}"
            log.warning("hotswap.path_mismatch", target=t.name, lora_name=name, served=root, sent=path)
        detail["unloaded"], detail["unload_errors"] = _unload_extra(c, adapter, list(served), t.keep_loaded)
        detail["loaded"] = [n for n in ours(served, adapter.prefix) if n not in detail["unloaded"]]
        return detail

    return with_retries(
        attempt, target=t.name, kind=t.kind, retries=t.retries, backoff_s=t.backoff_s, sleep=sleep, clock=clock, log=log
    )


def _unload_extra(c: _Client, adapter: AdapterRef, served: list[str], keep: int) -> tuple[list[str], dict]:
    """Unload failures do not fail the swap (the new version is served); they are reported."""
    unloaded: list[str] = []
    errors: dict[str, str] = {}
    for old in plan_unloads(ours(served, adapter.prefix), adapter.name, keep):
        try:
            r = c.post("unload", {"lora_name": old})
        except TargetError as e:
            errors[old] = str(e)
            continue
        gone = r.status == 404 or (c.t.kind == "sglang" and "does not exist" in r.message())
        if r.ok or gone:  # already gone is what we wanted
            unloaded.append(old)
        else:
            errors[old] = f"HTTP {r.status}: {r.message()}"
    return unloaded, errors
