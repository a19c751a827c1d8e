"""Enums, exit codes and names every part shares."""

from __future__ import annotations

import re
import secrets
from enum import IntEnum, StrEnum

from pydantic import BaseModel, ConfigDict


class Outcome(StrEnum):
    """How a run ended (a metric label: keep the set small)."""

    succeeded = "succeeded"
    failed = "failed"
    skipped = "skipped"
    rejected = "rejected"
    interrupted = "interrupted"


class QuarantineReason(StrEnum):
    """Why a record (or a whole file) was quarantined (a metric label: keep the set small)."""

    invalid_json = "invalid_json"
    invalid_utf8 = "invalid_utf8"
    bad_file = "bad_file"
    missing_field = "missing_field"
    empty_field = "empty_field"
    wrong_type = "wrong_type"
    too_long = "too_long"  # more tokens than max_seq_length
    too_large = "too_large"  # over the bytes read per record, nested too deep, a number too long to parse
    bad_row = "bad_row"  # a CSV row whose fields do not match the header (or that the CSV reader rejects)
    special_tokens = "special_tokens"  # control-token text in content ([train] special_tokens = "reject")
    outside_inbox = "outside_inbox"  # a symbolic link out of the inbox (not followed, not read)
    unreadable = "unreadable"  # the file vanished, changed while read, or cannot be opened; retried next pull
    internal_error = "internal_error"  # an unexpected error on this record or file: kept, the night goes on
    unpaired = "unpaired"  # a preference record that names no better reply (one rating of 0 or below, a tie)


class Method(StrEnum):
    """How a night trains (`[train] method`; a metric label and part of every manifest)."""

    qlora = "qlora"  # 4-bit base, LoRA on top: a version is a LoRA adapter
    lora = "lora"  # 16-bit base, LoRA on top: a version is a LoRA adapter
    full = "full"  # every weight trained: a version is a whole model directory

    @property
    def is_adapter(self) -> bool:
        return self is not Method.full

    def on(self, cuda: bool) -> Method:
        """What this method trains as on this machine: qlora's 4-bit base needs CUDA; without it the base stays
        in full precision, which is lora (the honest label for a CPU night's adapter)."""
        return Method.lora if self is Method.qlora and not cuda else self


class Phase(StrEnum):
    pull = "pull"
    plan = "plan"
    load = "load"
    train = "train"
    evaluate = "evaluate"
    publish = "publish"
    hotswap = "hotswap"


class ExitCode(IntEnum):
    """Exit statuses of every `nightshift` command and of the night's child."""

    OK = 0
    FAILED = 1  # the night or the command failed: the log says why
    USAGE = 2  # bad command line or bad config: every problem is printed
    INTERRUPTED = 3  # stopped on request; the checkpoint is saved and the next start resumes
    HOTSWAP_FAILED = 4  # published, but at least one inference server did not take it
    BUSY = 5  # another nightshift process holds the state directory



class Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def nightshift_version() -> str:
    """The installed package's version (manifests, metrics, `--version`)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nightshift")
    except PackageNotFoundError:
        return "unknown"


def new_run_id(night: str) -> str:
    """`2026-11-21-3f9a0c`: chosen by the supervisor (its log lines carry it), handed to the child."""
    return f"{night}-{secrets.token_hex(3)}"


def outcome_exit_code(outcome: Outcome) -> ExitCode:
    return {Outcome.failed: ExitCode.FAILED, Outcome.interrupted: ExitCode.INTERRUPTED}.get(outcome, ExitCode.OK)


def version_name(name: str, version: int) -> str:
    """`tiny`, 3 -> `tiny-v0003`: names are never reused (inference servers cache by name)."""
    return f"{name}-v{version:04d}"


def parse_version_name(name: str) -> tuple[str, int] | None:
    """`tiny-v0007` -> ("tiny", 7); anything else (a base model, a foreign adapter) -> None."""
    m = re.fullmatch(r"(?P<prefix>[A-Za-z0-9_.-]+?)-v(?P<version>\d{4,})", name)
    return (m["prefix"], int(m["version"])) if m else None
