"""Fixtures shared by the HTTP API tests (a demo engine and a server around it). The server
modules are imported inside the fixtures, so tests that need no server run where the server's
dependencies are not installed (the GPU machine)."""

import pytest


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """One demo engine per test module, its demo checkpoint in a private cache directory."""
    from server_fixtures import demo_engine

    mp = pytest.MonkeyPatch()
    mp.setenv("FREETOKEN_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    try:
        yield demo_engine()
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def server(engine):
    from server_fixtures import MODEL, running_server

    with running_server(engine, MODEL, max_running=8) as (base, core):
        yield base, core


@pytest.fixture
def fresh_engine(engine):
    """A demo engine of this test's own, for a server with its own settings in a module whose
    `server` fixture drives the shared one (one scheduler per engine at a time)."""
    from server_fixtures import demo_engine

    return demo_engine()
