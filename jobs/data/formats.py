"""Record formats: recognise a record, map operator field names, validate, normalise.

Every accepted record becomes one of two normal forms, which is what gets hashed
(so the same sample from any file or format is kept once) and stored in the ledger:
  {"messages": [{"role": ..., "content": ...}, ...]}   (alpaca, chat, prompt/completion)
  {"text": "..."}                                        (raw text: every token is trained on)
and a preference pair is the first with its rejected reply beside it (jobs/data/preference.py, which the
inbox's check calls first: `normalise_record`).
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from dataclasses import dataclass
from typing import Any, Literal

from jobs.contract import QuarantineReason

Format = Literal["auto", "alpaca", "chat", "prompt_completion", "text", "preference"]
ROLES = {"system", "user", "assistant"}
RECORD_FIELDS = ("messages", "instruction", "input", "output", "prompt", "completion", "text")  # what detect() reads
MAX_MESSAGES = 256  # per conversation: finding the trained spans renders every prefix (quadratic in turns)


class RecordError(ValueError):
    """A record that cannot be trained on; `reason` is a low-cardinality code (a metric label)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = QuarantineReason(reason).value  # a reason outside the contract's set is a bug
        self.detail = detail

    def __reduce__(self) -> tuple[type[RecordError], tuple[str, str]]:
        """Pickled with both arguments: a pull worker's quarantined records come back to the night's process
        (an exception pickles its `args` alone, here the detail, and could not be rebuilt: it broke the pool)."""
        return type(self), (self.reason, self.detail)


@dataclass(frozen=True)
class Normalised:
    record: dict[str, Any]
    hash: str


ABSENT: Any = object()  # a key not in the record, told apart from one written as null


def _text(value: Any, field: str, *, required: bool = True) -> str:
    if value is ABSENT or (value is None and not required):
        if required:
            raise RecordError("missing_field", f"field '{field}' is missing")
        return ""
    if value is None:
        raise RecordError("wrong_type", f"field '{field}' is null (a string is needed)")
    if not isinstance(value, str):
        raise RecordError("wrong_type", f"field '{field}' must be a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:  # JSON's "\ud800": text no tokenizer, file or database can hold
        raise RecordError("invalid_utf8", f"field '{field}' holds invalid Unicode ({e.reason} at {e.start})") from None
    value = unicodedata.normalize("NFC", value).strip()
    if required and not value:
        raise RecordError("empty_field", f"field '{field}' is empty")
    return value


def detect(record: dict[str, Any]) -> Format:
    if "messages" in record:
        return "chat"
    if "instruction" in record or "output" in record:
        return "alpaca"
    if "prompt" in record or "completion" in record:
        return "prompt_completion"
    if "text" in record:
        return "text"
    raise RecordError(
        "missing_field",
        "no known fields: expected 'messages', 'instruction'+'output', 'prompt'+'completion' or 'text' "
        f"(got {sorted(record)[:8]})",
    )


def normalise(record: Any, fmt: Format = "auto", field_map: dict[str, str] | None = None) -> Normalised:
    """Validate one record and return its normal form and content hash.

    `field_map` maps the operator's field names onto ours, e.g. {"question": "instruction"}.
    """
    if not isinstance(record, dict):
        raise RecordError("wrong_type", f"a record must be an object, got {type(record).__name__}")
    if field_map:
        record = {field_map.get(k, k): v for k, v in record.items()}
    kind = detect(record) if fmt == "auto" else fmt
    if kind == "alpaca":
        instruction = _text(record.get("instruction", ABSENT), "instruction")
        extra = _text(record.get("input", ABSENT), "input", required=False)
        prompt = f"{instruction}\n\n{extra}" if extra else instruction
        norm = {"messages": [_msg("user", prompt), _msg("assistant", _text(record.get("output", ABSENT), "output"))]}
    elif kind == "prompt_completion":
        norm = {
            "messages": [
                _msg("user", _text(record.get("prompt", ABSENT), "prompt")),
                _msg("assistant", _text(record.get("completion", ABSENT), "completion")),
            ]
        }
    elif kind == "chat":
        norm = {"messages": _messages(record.get("messages", ABSENT))}
    else:
        norm = {"text": _text(record.get("text", ABSENT), "text")}
    return hashed(norm)


def hashed(norm: dict[str, Any]) -> Normalised:
    """The normal form with its content hash (the ledger's identity of a sample, whatever file it came in)."""
    canonical = json.dumps(norm, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return Normalised(norm, hashlib.sha256(canonical.encode()).hexdigest())


def _msg(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def turns(value: Any, field: str) -> list[dict[str, str]]:
    """A field holding a list of {role, content} turns, each checked; errors name the field and the turn."""
    if value is ABSENT:
        raise RecordError("missing_field", f"field '{field}' is missing")
    if value is None:
        raise RecordError("wrong_type", f"field '{field}' is null (a list of turns is needed)")
    if not isinstance(value, list):
        raise RecordError("wrong_type", f"field '{field}' must be a list, got {type(value).__name__}")
    if not value:
        raise RecordError("empty_field", f"field '{field}' is empty")
    if len(value) > MAX_MESSAGES:
        raise RecordError("too_large", f"field '{field}' has {len(value)} turns (at most {MAX_MESSAGES})")
    out = []
    for i, m in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(m, dict):
            raise RecordError("wrong_type", f"{where} must be an object with 'role' and 'content'")
        role = _text(m.get("role", ABSENT), f"{where}.role")
        if role not in ROLES:
            raise RecordError("wrong_type", f"{where}.role must be one of {sorted(ROLES)}, got '{role}'")
        out.append(_msg(role, _text(m.get("content", ABSENT), f"{where}.content")))
    return out


def _messages(value: Any) -> list[dict[str, str]]:
    out = turns(value, "messages")
    if not any(m["role"] == "assistant" for m in out):
        raise RecordError("missing_field", "field 'messages' has no assistant turn to train on")
    return out
