"""Preference records: a prompt with a chosen and a rejected reply (and the common ways people give one).

Why one normal form that is also a supervised record: a pair is kept as the chosen conversation plus the
rejected reply's text,
  {"messages": [...the prompt's turns..., {"role": "assistant", "content": CHOSEN}], "rejected": REJECTED}
so the pull's guards, quarantine, token cache and exactly-once ledger take it unchanged (its tokens are the
chosen conversation's), a supervised night trains on the chosen reply, and a preference night
(`[train] objective = "dpo"`, jobs/training/preference/dpo.py) reads both replies back from the ledger.

Accepted shapes (field names after the source's field_map):
- pair:    {"prompt" | "messages", "chosen", "rejected"}; chosen/rejected as text, as an assistant message, or
           as whole conversations that share their turns before the last (TRL's implicit-prompt form);
- edit:    {"prompt" | "messages", "completion" | "original", "edited"}: the edit is chosen over the original;
- ratings: {"prompt" | "messages", "replies": [{"content", "rating"}, ...]}: the best rated over the worst;
- rating:  {"prompt" | "messages", "completion", "rating"}: a rating above 0 (or true) is a supervised record;
           a rating of 0 or below alone names no better reply: quarantined as `unpaired` (kept, not lost).
An optional "system" adds a system turn. "prompt" is text; "messages" is the conversation before the reply
(its last turn is the user's).
"""

from __future__ import annotations

from typing import Any

from jobs.data.formats import ABSENT, Format, Normalised, RecordError, _msg, _text, hashed, normalise, turns
from jobs.data.render import OverlongPolicy, SpecialTokens, tokenize_record

PREFERENCE_KEYS = ("chosen", "rejected", "edited", "replies", "rating")


def is_preference(record: dict[str, Any]) -> bool:
    """A record that names a preference (pair, edit, ratings, rating): what the pull dispatches here."""
    return any(k in record for k in PREFERENCE_KEYS)


def normalise_record(record: Any, fmt: Format = "auto", field_map: dict[str, str] | None = None) -> Normalised:
    """What the inbox's check calls: a preference record here, any other through jobs/data/formats.py."""
    if fmt == "preference" and not isinstance(record, dict):
        raise RecordError("wrong_type", f"a record must be an object, got {type(record).__name__}")
    if isinstance(record, dict) and fmt in ("auto", "preference"):
        mapped = {field_map.get(k, k): v for k, v in record.items()} if field_map else record
        if fmt == "preference" or is_preference(mapped):
            return normalise_preference(mapped)
    return normalise(record, fmt, field_map)


def is_pair(record: dict[str, Any]) -> bool:
    """A normal form that holds a pair (a preference night trains it with both replies)."""
    return isinstance(record.get("rejected"), str) and "messages" in record


def normalise_preference(record: dict[str, Any]) -> Normalised:
    """Validate one preference record; every error names the field."""
    if "chosen" in record or "rejected" in record:
        context, chosen, rejected = _pair(record)
    elif "edited" in record:
        context = _context(record)
        orig_field = next((k for k in ("original", "completion", "reply") if k in record), "original")
        rejected = _text(record.get(orig_field, ABSENT), orig_field)
        chosen = _text(record.get("edited", ABSENT), "edited")
    elif "replies" in record:
        context = _context(record)
        chosen, rejected = _rated(record.get("replies"))
    else:
        context = _context(record)
        reply_field = next((k for k in ("completion", "reply", "output") if k in record), "completion")
        reply = _text(record.get(reply_field, ABSENT), reply_field)
        if not _good(record.get("rating")):
            raise RecordError("unpaired", f"field 'rating' ({record.get('rating')!r}) marks the reply as not good and "
                              "names no better one: give 'chosen' and 'rejected', an 'edited' reply, or rate two "
                              "'replies'")
        return hashed({"messages": [*context, _msg("assistant", reply)]})
    if chosen == rejected:
        raise RecordError("unpaired", "fields 'chosen' and 'rejected' hold the same reply: nothing to prefer")
    return hashed({"messages": [*context, _msg("assistant", chosen)], "rejected": rejected})


def pair_messages(record: dict[str, Any]) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """The chosen and the rejected conversation of a normal-form pair."""
    msgs = record["messages"]
    return msgs, [*msgs[:-1], _msg("assistant", record["rejected"])]


def _messages_context(value: Any, field: str, *, last: str = "user") -> list[dict[str, str]]:
    """A list of turns whose last is `last`'s (the context before a reply, or a whole conversation)."""
    out = turns(value, field)
    if out[-1]["role"] != last:
        raise RecordError("wrong_type", f"the last turn of '{field}' must be the {last}'s, got '{out[-1]['role']}'")
    return out


def _context(record: dict[str, Any]) -> list[dict[str, str]]:
    system = _text(record.get("system", ABSENT), "system", required=False)
    head = [_msg("system", system)] if system else []
    if "messages" in record:
        turns = _messages_context(record.get("messages", ABSENT), "messages")
    else:
        turns = [_msg("user", _text(record.get("prompt", ABSENT), "prompt"))]
    return [*head, *turns]


def _reply(value: Any, field: str) -> str:
    if isinstance(value, dict):
        if value.get("role", "assistant") != "assistant":
            raise RecordError("wrong_type", f"field '{field}.role' must be 'assistant', got {value.get('role')!r}")
        return _text(value.get("content", ABSENT), f"{field}.content")
    return _text(value, field)


def _pair(record: dict[str, Any]) -> tuple[list[dict[str, str]], str, str]:
    chosen, rejected = record.get("chosen"), record.get("rejected")
    for name, v in (("chosen", chosen), ("rejected", rejected)):
        if v is None:
            raise RecordError("missing_field", f"field '{name}' is missing (a pair needs 'chosen' and 'rejected')")
    if isinstance(chosen, list) or isinstance(rejected, list):  # whole conversations sharing a prefix
        if not (isinstance(chosen, list) and isinstance(rejected, list)):
            raise RecordError("wrong_type", "fields 'chosen' and 'rejected' must both be conversations or both "
                              "replies")
        c = _messages_context(chosen, "chosen", last="assistant")
        r = _messages_context(rejected, "rejected", last="assistant")
        prefix = _context(record) if ("prompt" in record or "messages" in record) else []
        if c[:-1] != r[:-1]:
            raise RecordError("wrong_type", "fields 'chosen' and 'rejected' differ before their last turn: "
                              "they must answer the same conversation")
        return [*prefix, *c[:-1]], c[-1]["content"], r[-1]["content"]
    return _context(record), _reply(chosen, "chosen"), _reply(rejected, "rejected")


def _number(value: Any, field: str) -> float:
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())  # CSV cells are text
        except ValueError:
            pass
    raise RecordError("wrong_type", f"field '{field}' must be a number or true/false, got {value!r}")


def _good(value: Any) -> bool:
    if value is None:
        raise RecordError("missing_field", "field 'rating' is missing")
    if isinstance(value, str) and value.strip().lower() in ("up", "good", "true", "down", "bad", "false"):
        return value.strip().lower() in ("up", "good", "true")
    return _number(value, "rating") > 0


def _rated(value: Any) -> tuple[str, str]:
    if not isinstance(value, list):
        raise RecordError("wrong_type" if value is not None else "missing_field",
                          f"field 'replies' must be a list of {{'content', 'rating'}}, got {type(value).__name__}")
    rated = []
    for i, r in enumerate(value):
        if not isinstance(r, dict):
            raise RecordError("wrong_type", f"replies[{i}] must be an object with 'content' and 'rating'")
        if "rating" not in r:
            raise RecordError("missing_field", f"field 'replies[{i}].rating' is missing")
        rated.append((_number(r["rating"], f"replies[{i}].rating"), i, _reply(r, f"replies[{i}]")))
    if len(rated) < 2:
        raise RecordError("unpaired", f"field 'replies' holds {len(rated)} reply: a preference needs two")
    best = max(rated, key=lambda x: (x[0], -x[1]))  # the first of the best, the last of the worst
    worst = min(rated, key=lambda x: (x[0], -x[1]))
    if best[0] == worst[0]:
        raise RecordError("unpaired", f"every reply in 'replies' has the rating {best[0]:g}: nothing to prefer")
    return best[2], worst[2]


def check_rejected(tokenizer: Any, record: dict[str, Any], *, max_seq_length: int, overlong: OverlongPolicy,
                   special_tokens: SpecialTokens) -> None:
    """The rejected conversation passes the same token guards as the chosen one (the pull tokenises the chosen
    one; a pair whose rejected reply cannot be trained on is quarantined with the reason, naming the field)."""
    if not is_pair(record):
        return
    _, rejected = pair_messages(record)
    try:
        tokenize_record(tokenizer, 0, {"messages": rejected}, max_seq_length=max_seq_length, overlong=overlong,
                        special_tokens=special_tokens)
    except RecordError as e:
        raise RecordError(e.reason, f"field 'rejected': {e.detail}") from None
