"""A full fine-tuned version (a whole model directory, `method = "full"`) to vLLM or SGLang.

These servers load LoRA adapters at runtime; a whole model is another matter:

- vLLM (checked in its docs and source, 0.11 - 0.33): no production API replaces the served
  weights. Sleep / wake_up / collective_rpc("reload_weights") exist only with
  VLLM_SERVER_DEV_MODE=1 ("these endpoints should not be exposed to users"). So a full version is
  refused with a message saying what to use instead (a `command` or `webhook` target that
  restarts the server on the new directory).
- SGLang documents `POST /update_weights_from_disk` (docs/basic_usage/native_api.ipynb, "Update
  Weights From Disk": "Update model weights from disk without restarting the server. Only
  applicable for models with the same architecture and parameter size"): body {"model_path",
  "weight_version"} (weight_version: 0.5.2 and later; older servers ignore it), answer
  {"success", "message", "num_paused_requests"}, HTTP 200 on success and 400 otherwise. Requests
  wait while it loads; the radix cache is flushed. Clients keep using the served model's name.
  `full_versions = "refuse"` on the target turns this off (e.g. when the server also serves
  LoRA adapters trained on the old weights).
"""

from __future__ import annotations

import time
from typing import Any

from jobs.hotswap.config import LoraServerTarget, SecretError
from jobs.hotswap.core import AdapterRef, Clock, HotswapOutcome, Sleep, TargetError, with_retries
from jobs.hotswap.lora_server import lora_path_for
from jobs.hotswap.transport import post_json, retryable_status, tls_context

ROUTE = "/update_weights_from_disk"


def refusal(t: LoraServerTarget, adapter: AdapterRef) -> str:
    if t.kind == "vllm":
        return (f'{adapter.name} is a full fine-tuned model (method = "full"), not a LoRA adapter: vLLM has no '
                "production API to reload a whole model (only dev-mode endpoints). Serve it with a `command` or "
                "`webhook` target that restarts vLLM on the new directory, or train a LoRA method")
    return (f'{adapter.name} is a full fine-tuned model (method = "full"), not a LoRA adapter, and target '
            f'{t.name} has full_versions = "refuse": reload it by hand (POST {ROUTE}) or by a command target')


def swap(t: LoraServerTarget, adapter: AdapterRef, *, sleep: Sleep, clock: Clock = time.monotonic,
         log: Any) -> HotswapOutcome:
    """SGLang: replace the served weights with the version's; anything else: a clear refusal (not retried)."""
    if not t.reloads_full_versions:
        return HotswapOutcome(target=t.name, kind=t.kind, ok=False, attempts=0, error=refusal(t, adapter),
                              detail={"method": adapter.method.value, "path": str(adapter.path)})
    path = lora_path_for(t, adapter)  # remote_adapters_dir applies to model directories too
    if not t.verify_tls and t.base_url.startswith("https:"):
        log.warning("hotswap.tls_unverified", target=t.name, url=t.base_url)

    def attempt(_: int) -> dict[str, Any]:
        try:
            key = t.api_key()
        except SecretError as e:
            raise TargetError(str(e), retryable=False) from e
        r = post_json(t.base_url + ROUTE, {"model_path": path, "weight_version": adapter.name},
                      headers={"Authorization": f"Bearer {key}"} if key else {}, timeout_s=t.reload_timeout_s,
                      max_body=t.max_body_bytes, ctx=tls_context(t.verify_tls, t.ca_bundle))
        body = r.json()
        if r.ok and isinstance(body, dict) and body.get("success") is True:
            return {"model_path": path, "weight_version": adapter.name, "message": body.get("message"),
                    "num_paused_requests": body.get("num_paused_requests")}
        if r.status == 404:
            raise TargetError(f"{ROUTE}: HTTP 404: this server has no full-weight reload (SGLang documents it "
                              "since 0.4)", retryable=False, detail={"status": 404})
        raise TargetError(f"reload {adapter.name}: HTTP {r.status}: {r.message()}",
                          retryable=retryable_status(r.status), detail={"status": r.status})

    return with_retries(attempt, target=t.name, kind=t.kind, retries=t.retries, backoff_s=t.backoff_s, sleep=sleep,
                        clock=clock, log=log)
