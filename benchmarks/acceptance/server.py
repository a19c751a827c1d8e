"""The acceptance run's inference server: generation with a base model and runtime LoRA loading behind
the same HTTP API nightshift uses for vLLM, on transformers + PEFT.

    python -m benchmarks.acceptance.server --model DIR --port-file F [--hold-fraction 0.3]

Routes (as vLLM 0.11-0.33 answers them: plain-text "Success: ..." on a load or an unload, errors as
{"error": {"message", "type", "param", "code"}}, JSON bodies only):
- POST /v1/load_lora_adapter {lora_name, lora_path}: `model.load_adapter(path, adapter_name=name)`
  (transformers' PeftAdapterMixin: the base is never reloaded); 400 when the name is taken, 404
  when the path holds no adapter.
- POST /v1/unload_lora_adapter {lora_name}: `model.delete_adapter(name)` (frees its weights).
- GET /v1/models: the base model and every loaded adapter (id, root = path, parent = base).
- POST /v1/completions {model, prompt, max_tokens}: greedy generation with that adapter active
  (`set_adapter`; the base: adapters disabled); the answer also says which adapter answered and a
  digest of the prompt's last-position logits (outputs of one version are identical; another
  version's differ).
- GET /stats: memory (torch's peak reserved, the held share), requests, adapters.
- POST /admin/grow {gb}: hold that much more memory (an inference server growing mid-night).

One lock around the model: `set_adapter` changes module state globally, so a swap must never
land in the middle of a generation (transformers + PEFT notes). `--hold-fraction` keeps that
share of the card's memory reserved, as vLLM's KV cache pre-allocation does.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

BASE_NAME = "base"


def logits_digest(logits: Any) -> str:
    """Identity of a version's outputs: the last position's logits, rounded (stable across calls)."""
    import torch

    v = torch.round(logits.detach().float().cpu() * 100).to(torch.int64).numpy().tobytes()
    return hashlib.sha256(v).hexdigest()[:16]


def prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return list(ids) or [int(tokenizer.eos_token_id or 0)]


class Server:
    def __init__(self, model_dir: Path, *, device: str, hold_fraction: float) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.device = device
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, local_files_only=True)
        self.model.to(device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        self.model_dir = model_dir
        self.adapters: dict[str, str] = {}
        self.lock = threading.Lock()
        self.requests = 0
        self.ballast: list[Any] = []
        if device.startswith("cuda") and hold_fraction > 0:
            total = torch.cuda.mem_get_info()[1]
            self.grow(max(0, int(hold_fraction * total) - torch.cuda.memory_reserved()))

    # ---- memory -----------------------------------------------------------------------------------
    def grow(self, nbytes: int) -> int:
        if self.device.startswith("cuda") and nbytes > 0:
            self.ballast.append(self.torch.empty(nbytes, dtype=self.torch.uint8, device=self.device))
        return sum(int(b.numel()) for b in self.ballast)

    def stats(self) -> dict[str, Any]:
        cuda = self.device.startswith("cuda")
        t = self.torch
        return {"pid": os.getpid(), "device": self.device, "requests": self.requests, "adapters": dict(self.adapters),
                "ballast_bytes": sum(int(b.numel()) for b in self.ballast),
                "reserved_bytes": int(t.cuda.memory_reserved()) if cuda else None,
                "peak_reserved_bytes": int(t.cuda.max_memory_reserved()) if cuda else None,
                "total_bytes": int(t.cuda.mem_get_info()[1]) if cuda else None}

    # ---- adapters (the vLLM routes) -------------------------------------------------------------
    def load(self, name: str, path: str) -> tuple[int, Any]:
        if not name or not path:
            return 400, _error(400, "Both 'lora_name' and 'lora_path' must be provided.")
        if name in self.adapters:
            return 400, _error(400, f"The lora adapter '{name}' has already been loaded.")
        if not (Path(path) / "adapter_config.json").is_file():
            return 404, _error(404, f"Loading lora {name} failed: No adapter found for {path}")
        with self.lock:
            try:
                self.model.load_adapter(path, adapter_name=name)
            except Exception as e:  # an adapter this base cannot take: the engine's 500
                return 500, _error(500, f"Loading lora {name} failed: {type(e).__name__}: {e}")
            self.adapters[name] = path
        return 200, f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, name: str) -> tuple[int, Any]:
        if name not in self.adapters:
            return 404, _error(404, f"The lora adapter '{name}' cannot be found.")
        with self.lock:
            self.model.delete_adapter(name)
            del self.adapters[name]
        return 200, f"Success: LoRA adapter '{name}' removed successfully."

    def models(self) -> dict[str, Any]:
        cards = [{"id": BASE_NAME, "object": "model", "root": str(self.model_dir), "parent": None}]
        cards += [{"id": n, "object": "model", "root": p, "parent": BASE_NAME} for n, p in self.adapters.items()]
        return {"object": "list", "data": cards}

    # ---- generation -------------------------------------------------------------------------------
    def complete(self, body: dict[str, Any]) -> tuple[int, Any]:
        name = str(body.get("model") or BASE_NAME)
        if name != BASE_NAME and name not in self.adapters:
            return 404, _error(404, f"The model `{name}` does not exist.")
        t = self.torch
        ids = t.tensor([prompt_ids(self.tokenizer, str(body.get("prompt", "")))], device=self.device)
        with self.lock, t.no_grad():
            if self.adapters:
                if name == BASE_NAME:
                    self.model.disable_adapters()
                else:
                    self.model.enable_adapters()
                    self.model.set_adapter(name)
            digest = logits_digest(self.model(input_ids=ids).logits[0, -1])
            out = self.model.generate(ids, max_new_tokens=int(body.get("max_tokens", 8)), do_sample=False,
                                      pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id)
            active = name if name == BASE_NAME or name in self.adapters else None
            self.requests += 1
        new = out[0, ids.shape[1]:].tolist()
        return 200, {"object": "text_completion", "model": name,
                     "choices": [{"index": 0, "text": self.tokenizer.decode(new), "token_ids": new}],
                     "acceptance": {"adapter": active, "logits_digest": digest}}


def _error(code: int, message: str) -> dict[str, Any]:
    kind = {400: "InvalidUserInput", 404: "NotFoundError"}.get(code, "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def handler(server: Server) -> type[BaseHTTPRequestHandler]:
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a: Any) -> None:
            pass

        def _send(self, status: int, payload: Any) -> None:
            text = isinstance(payload, str)
            data = payload.encode() if text else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; charset=utf-8" if text else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                return self._send(200, server.models())
            if self.path == "/stats":
                return self._send(200, server.stats())
            return self._send(404, _error(404, "Not Found"))

        def do_POST(self) -> None:
            if not self.headers.get("Content-Type", "").startswith("application/json"):
                return self._send(400, _error(400, "Unsupported Media Type: Only 'application/json' is allowed"))
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            except ValueError:
                return self._send(400, _error(400, "the body is not JSON"))
            try:
                if self.path == "/v1/load_lora_adapter":
                    return self._send(*server.load(str(body.get("lora_name") or ""), str(body.get("lora_path") or "")))
                if self.path == "/v1/unload_lora_adapter":
                    return self._send(*server.unload(str(body.get("lora_name") or "")))
                if self.path == "/v1/completions":
                    return self._send(*server.complete(body))
                if self.path == "/admin/grow":
                    held = server.grow(int(float(body.get("gb", 0)) * 1e9))
                    return self._send(200, {"ballast_bytes": held})
            except Exception as e:  # the engine failed on this request: the client sees a 500
                return self._send(500, _error(500, f"{type(e).__name__}: {e}"))
            return self._send(404, _error(404, "Not Found"))

    return H


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.acceptance.server")
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--port-file", type=Path, required=True, help="the port is written here once serving")
    ap.add_argument("--hold-fraction", type=float, default=0.0, help="share of the card's memory to hold")
    ap.add_argument("--device", default="auto")
    a = ap.parse_args(argv)
    import torch

    from jobs.training.backends.peft_env import hide_torchao_peft_refuses

    hide_torchao_peft_refuses()  # an older torchao beside Unsloth makes PEFT refuse every LoRA load

    device = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
    srv = Server(a.model, device=device, hold_fraction=a.hold_fraction)
    httpd = ThreadingHTTPServer(("127.0.0.1", a.port), handler(srv))
    httpd.daemon_threads = True
    tmp = a.port_file.with_suffix(".tmp")
    tmp.write_text(str(httpd.server_address[1]))
    os.replace(tmp, a.port_file)
    print(f"acceptance server: {a.model} on {device}, port {httpd.server_address[1]}, "
          f"holding {srv.stats()['ballast_bytes'] / 1e9:.1f} GB", file=sys.stderr, flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        httpd.serve_forever(0.2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
