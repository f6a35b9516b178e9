"""Fixtures shared by the HTTP API tests (a demo engine and a server around it)."""

import pytest

from server_fixtures import MODEL, demo_engine, running_server


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """One demo engine per test module, its demo checkpoint in a private cache directory."""
    mp = pytest.MonkeyPatch()
    mp.setenv("FREETOKEN_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    try:
        yield demo_engine()
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def server(engine):
    with running_server(engine, MODEL, max_running=8) as (base, core):
        yield base, core
