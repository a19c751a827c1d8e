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

Never a stale adapter (vLLM issue 42125: a same-name reload keeps serving the old adapter's
prefix-cache blocks): a version is served as `<name>-<8 hex of its files' sha256>`
(AdapterRef.served_name), so no two weights share a name, from this state directory or another.
Before loading, the server's list is read: a name held from another path is unloaded and loaded
again; the same name from the same path is already there (a re-send). Every load is preflighted
(jobs.hotswap.preflight); a refusal that will not change (4xx, a 500 saying the rank or a feature is
unsupported) ends the swap at once.
"""

from __future__ import annotations

import time
from typing import Any

import jobs.hotswap.preflight as preflight
from jobs.hotswap.config import LoraServerTarget, SecretError
from jobs.hotswap.core import (
    AdapterRef,
    Clock,
    HotswapOutcome,
    Sleep,
    TargetError,
    parse_served_name,
    with_retries,
)
from jobs.hotswap.transport import Response, post_json, request, retryable_status, tls_context

ROUTES = {
    "vllm": {"load": "/v1/load_lora_adapter", "unload": "/v1/unload_lora_adapter", "list": "/v1/models",
             "info": None},
    "sglang": {"load": "/load_lora_adapter", "unload": "/unload_lora_adapter", "list": "/v1/models",
               "info": "/get_server_info"},
}


class Client:
    def __init__(self, t: LoraServerTarget) -> None:
        self.t = t
        self.routes = ROUTES[t.kind]
        self.ctx = tls_context(t.verify_tls, t.ca_bundle)
        try:
            key = t.api_key()
        except SecretError as e:
            raise TargetError(str(e), retryable=False) from e
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.deadline = time.monotonic() + t.timeout_s  # one attempt, all its exchanges, ends here

    def kw(self) -> dict[str, Any]:
        return {"headers": self.headers, "timeout_s": self.t.timeout_s, "ctx": self.ctx,
                "max_body": self.t.max_body_bytes, "deadline": self.deadline}

    def post(self, route: str, payload: dict[str, Any]) -> Response:
        return post_json(self.t.base_url + str(self.routes[route]), payload, **self.kw())

    def get(self, route: str) -> Response:
        return request("GET", self.t.base_url + str(self.routes[route]), **self.kw())

    def limits(self) -> preflight.ServerLimits:
        """What the server can load: SGLang says it at /get_server_info; vLLM: the target's settings."""
        info = None
        if self.routes["info"]:
            try:
                r = self.get("info")
                info = r.json() if r.ok else None
            except TargetError:
                info = None  # an older build without the route: the configuration stands
        return preflight.limits_from(self.t, info)

    def cards(self) -> list[dict[str, Any]]:
        url = self.t.base_url + str(self.routes["list"])
        r = self.get("list")
        if not r.ok:
            raise TargetError(f"GET {url}: HTTP {r.status}: {r.message()}", retryable=retryable_status(r.status))
        data = r.json()
        items = data.get("data") if isinstance(data, dict) else None
        if not isinstance(items, list):
            raise TargetError(f"GET {url}: no data[] list in the answer", retryable=False)
        return [m for m in items if isinstance(m, dict) and "id" in m]

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
            return {str(m["id"]): m.get("root") for m in cards}, str(self.routes["list"])
        return {str(m["id"]): m.get("root") for m in self.cards()}, str(self.routes["list"])

    def unload(self, name: str) -> str | None:
        """None when `name` is gone (unloaded now or already), else why not."""
        try:
            r = self.post("unload", {"lora_name": name})
        except TargetError as e:
            return str(e)
        gone = r.status == 404 or (self.t.kind == "sglang" and "does not exist" in r.message())
        return None if r.ok or gone else f"HTTP {r.status}: {r.message()}"


def ours(names: list[str] | dict[str, Any], prefix: str) -> list[str]:
    """Our versioned names among those served, oldest version first."""
    found = [(p[1], n) for n in names if (p := parse_served_name(n)) and p[0] == prefix]
    return [n for _, n in sorted(found)]


def from_this_state(served: dict[str, Any], lora_path: str) -> dict[str, Any]:
    """The served names loaded from this state directory's adapters (beside `lora_path`, as the server names the
    files), or from files the server does not name: two state directories publishing the same adapter name to one
    server each kept only their own `keep_loaded` and unloaded the other's version in service."""
    home = lora_path.rstrip("/").rpartition("/")[0]
    return {n: r for n, r in served.items() if r is None or str(r).rstrip("/").rpartition("/")[0] == home}


def plan_unloads(loaded: list[str], just_loaded: str, keep_loaded: int) -> list[str]:
    """Which of our loaded names to unload, oldest first: we keep the one just loaded and the
    keep_loaded - 1 newest others (after a rollback these are the versions clients were
    using a moment ago). The one just loaded is never unloaded."""
    others = sorted((n for n in loaded if n != just_loaded), key=_version)
    keep = set(others[max(0, len(others) - (keep_loaded - 1)) :]) if keep_loaded > 1 else set()
    return [n for n in others if n not in keep]


def _version(name: str) -> int:
    parsed = parse_served_name(name)
    return parsed[1] if parsed else -1


def lora_path_for(t: LoraServerTarget, adapter: AdapterRef) -> str:
    if t.remote_adapters_dir:
        return f"{t.remote_adapters_dir.rstrip('/')}/{adapter.path.name}"
    return str(adapter.path)


def _refused(name: str, r: Response) -> TargetError:
    """A load the server answered with an error: retried only where another attempt can help."""
    msg = r.message()
    retry = retryable_status(r.status) and not (r.status == 500 and preflight.DETERMINISTIC_500.search(msg))
    return TargetError(f"load {name}: HTTP {r.status}: {msg}", retryable=retry, detail={"status": r.status})


def swap(
    t: LoraServerTarget,
    adapter: AdapterRef,
    *,
    sleep: Sleep,
    clock: Clock = time.monotonic,
    log: Any,
) -> HotswapOutcome:
    """Preflight, load `adapter` under its served name, confirm it is listed, unload our extra versions."""
    name, path = adapter.served_name, lora_path_for(t, adapter)
    if not t.verify_tls and t.base_url.startswith("https:"):
        log.warning("hotswap.tls_unverified", target=t.name, url=t.base_url)

    def attempt(_: int) -> dict[str, Any]:
        c = Client(t)
        if (adapter.path / "adapter_config.json").exists():  # else the server says what is missing
            preflight.check(t, name, preflight.adapter_shape(adapter.path), c.limits())
        detail: dict[str, Any] = {"lora_name": name, "lora_path": path, "already_loaded": False}
        before = c.served()[0]  # None: an SGLang whose /v1/models lists no adapters (its load answer will)
        if before is not None and name in before and before[name] not in (None, path):
            _replace_stale(c, name, before[name], detail, log)
        elif before is not None and name in before:
            detail["already_loaded"] = True
        body: Any = None
        if not detail["already_loaded"]:
            r = c.post("load", {"lora_name": name, "lora_path": path})
            body = r.json()
            if r.ok and isinstance(body, dict) and body.get("success") is False:  # SGLang says no
                raise TargetError(f"load {name}: {r.message()}", retryable=False)
            if not r.ok:
                held = c.served(body)[0] or {}
                if r.status in (400, 409) and held.get(name) not in (None, path):  # SGLang: said only now
                    _replace_stale(c, name, str(held[name]), detail, log)
                    r = c.post("load", {"lora_name": name, "lora_path": path})
                    body = r.json()
                    if not r.ok:
                        raise _refused(name, r)
                elif r.status in (400, 409) and (name in held or (t.kind == "sglang" and "already loaded" in
                                                                  r.message())):
                    detail["already_loaded"] = True  # a re-send: the server has it (SGLang says so in words)
                else:
                    raise _refused(name, r)
        served, said_by = c.served(body)
        if detail["already_loaded"] and name not in (served or {}):
            served, said_by = {**(served or {}), name: None}, "the server's 'already loaded' answer"
        if served is None:
            raise TargetError(f"{name}: the load answer lists no adapters and {c.routes['list']} lists none on "
                              "this server: cannot confirm the load", retryable=False)
        if name not in served:
            raise TargetError(f"{name} was accepted but is not listed by the {said_by}", retryable=True)
        if served[name] not in (None, path):
            raise TargetError(f"{name} is served from {served[name]}, not {path}", retryable=True)
        detail["confirmed_by"] = said_by
        mine = from_this_state(served, path)
        detail["unloaded"], detail["unload_errors"] = _unload_extra(c, adapter, list(mine), t.keep_loaded)
        detail["loaded"] = [n for n in ours(mine, adapter.prefix) if n not in detail["unloaded"]]
        return detail

    return with_retries(
        attempt, target=t.name, kind=t.kind, retries=t.retries, backoff_s=t.backoff_s, sleep=sleep, clock=clock, log=log
    )


def _replace_stale(c: Client, name: str, held_from: str, detail: dict[str, Any], log: Any) -> None:
    """`name` is held from other files (a hand load, a restored backup): never trust a same-name reload."""
    detail["replaced_stale"] = held_from
    log.warning("hotswap.stale_name", target=c.t.name, lora_name=name, served=held_from, sent=detail["lora_path"])
    if (why := c.unload(name)) is not None:
        raise TargetError(f"{name} is held from {held_from} and cannot be unloaded: {why}", retryable=True)


def _unload_extra(c: Client, adapter: AdapterRef, served: list[str], keep: int) -> tuple[list[str], dict]:
    """Unload failures do not fail the swap (the new version is served); they are reported."""
    unloaded: list[str] = []
    errors: dict[str, str] = {}
    for old in plan_unloads(ours(served, adapter.prefix), adapter.served_name, keep):
        if (why := c.unload(old)) is None:
            unloaded.append(old)
        else:
            errors[old] = why
    return unloaded, errors
