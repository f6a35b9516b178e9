"""Filesystem locations freetoken owns."""

from __future__ import annotations

from pathlib import Path

from freetoken import settings


def cache_dir() -> Path:
    """Return freetoken's cache directory, creating it if needed.

    Holds derived, rebuildable artifacts (the built Qwen tokenizer, the demo
    checkpoint). Defaults to the platform's user cache dir. ``settings.CACHE_DIR``
    overrides it so tests, CI and sandboxed or read-only homes can point it at a
    scratch directory. The variable is read here, on every call, and nowhere else,
    so one override reaches every cached artifact and tests can monkeypatch it.
    """
    path = settings.cache_dir()
    if path is None:
        import platformdirs  # only here: kernels import this module, and some hosts lack it

        path = Path(platformdirs.user_cache_dir("freetoken"))
    path.mkdir(parents=True, exist_ok=True)
    return path
