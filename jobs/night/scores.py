"""Per-sample evaluation scores kept across nights: a model is scored once on a sample (issue 11: fast wake).

Why: every night measures the adapter in service, the base and the reference on the regression set, and
that set is made of earlier nights' held-out samples, which those same models were already scored on (the
service adapter as the candidate it was, the base every night): re-scoring them repeated work already done,
every night. A model's score of a sample depends on its weights and on how they were loaded, so the key
is the model ("base", or a published version "v<n>", whose files never change) together with the base's
path, the method, the compute, the backend and the tokenisation; a sample is keyed by its id and a hash of
its tokens, so a changed rendering is scored again. One JSON file per key under `state/cache/scores/`,
written atomically and private; an unreadable file is an empty cache (it only costs the scoring).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass
from pathlib import Path

import structlog

from jobs.data.batching import TokenizedSample
from jobs.learning.evaluate import SampleScore
from jobs.store.files import write_private_json

log = structlog.get_logger("nightshift.night")
BASE_MODEL = "base"
Scorer = Callable[[list[TokenizedSample]], dict[int, SampleScore]]


@dataclass(frozen=True)
class LoadIdentity:
    """How the models of a night are loaded: what a score depends on besides the weights."""

    base: str  # the base model's path
    method: str
    compute: str
    backend: str
    max_seq_length: int
    special_tokens: str

    def key(self, model: str) -> str:
        return hashlib.sha256(json.dumps([model, *astuple(self)]).encode()).hexdigest()[:20]


def sample_key(s: TokenizedSample) -> str:
    h = hashlib.sha256(json.dumps([s.input_ids, s.labels, s.reply_mask]).encode()).hexdigest()[:16]
    return f"{s.sample_id}:{h}"


class ScoreCache:
    def __init__(self, root: Path, ident: LoadIdentity) -> None:
        self.root, self.ident = root, ident

    def _path(self, model: str) -> Path:
        return self.root / f"{model}-{self.ident.key(model)}.json"

    def read(self, model: str) -> dict[str, SampleScore]:
        try:
            raw = json.loads(self._path(model).read_text())
            return {k: SampleScore(float(v[0]), int(v[1]), bool(v[2]), int(v[3]), int(v[4])) for k, v in raw.items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, TypeError, IndexError, AttributeError) as e:
            log.warning("score_cache_unreadable", model=model, error=str(e), note="scored again")
            return {}

    def add(self, model: str, samples: Sequence[TokenizedSample], scores: dict[int, SampleScore]) -> None:
        """Merge `scores` into what is kept for `model` (a failure to write only loses the saving)."""
        if not scores:
            return
        kept = self.read(model)
        kept.update({sample_key(s): scores[s.sample_id] for s in samples if s.sample_id in scores})
        try:
            write_private_json(self._path(model), {k: list(astuple(v)) for k, v in kept.items()})
        except OSError as e:
            log.warning("score_cache_not_written", model=model, error=str(e))

    def scored(self, model: str | None, samples: list[TokenizedSample], score: Scorer) -> dict[int, SampleScore]:
        """`samples`' scores under `model`: those kept, and the rest scored now (and kept). `model` None:
        a model with no lasting identity (a fresh adapter): everything is scored, nothing kept."""
        if model is None or not samples:
            return score(samples) if samples else {}
        kept = self.read(model)
        keys = {s.sample_id: sample_key(s) for s in samples}
        out = {sid: kept[k] for sid, k in keys.items() if k in kept}
        missing = [s for s in samples if s.sample_id not in out]
        if missing:
            fresh = score(missing)
            self.add(model, missing, fresh)
            out.update(fresh)
        log.info("scores", model=model, kept=len(samples) - len(missing), scored=len(missing))
        return out

    def forget_versions_except(self, versions: set[int]) -> None:
        """Drop the kept scores of versions no longer on disk (pruned by retention)."""
        for path in self.root.glob("v*-*.json"):
            with contextlib.suppress(ValueError, OSError):
                if int(path.name[1:].split("-", 1)[0]) not in versions:
                    path.unlink()


def version_model(version: int) -> str:
    return f"v{version}"

