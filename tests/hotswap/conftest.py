"""The real vLLM server for tests marked `vllm` (tests/fixtures/real_vllm.py): started once per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.real_vllm import VllmServer, missing_reason


@pytest.fixture(scope="session")
def vllm_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    why = missing_reason()
    if why is not None:
        pytest.skip(why)
    srv = VllmServer(tiny_model, tmp_path_factory.mktemp("vllm"))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
        print(f"\nvLLM on {srv.url}: start(s) took {', '.join(f'{s:.0f} s' for s in srv.starts)}")
