"""Chat templates a client sends, rendered where they can do no harm.

A chat template is a program: one with a loop of millions of steps froze every endpoint of
the server, /health included, while it rendered. Client templates are refused unless the
operator allows them (`--allow-request-chat-template`); then each renders in a worker process
(Jinja's sandbox, as for the checkpoint's own template: chat_template.py) that is
killed when it takes longer than `timeout` seconds, and the next one starts afresh.
"""

from __future__ import annotations

import multiprocessing
import threading
from pathlib import Path
from typing import Any

_tokenizer = None  # in the worker process: the checkpoint's tokenizer, loaded once
STARTUP_TIMEOUT = 120.0


def _serve(path: str, connection) -> None:
    global _tokenizer
    from freetoken.tokenizer import Tokenizer

    _tokenizer = Tokenizer(path)
    connection.send("ready")
    while True:
        messages, tools, kwargs = connection.recv()
        try:
            text = _tokenizer.render_chat(messages, tools=tools, **kwargs)
            connection.send((True, text))
        except Exception as e:  # the template's own error: the request's fault
            connection.send((False, f"{type(e).__name__}: {e}"))


class TemplateTimeout(Exception):
    pass


class TemplateSandbox:
    def __init__(self, tokenizer_path: Path, timeout: float):
        self.path, self.timeout = str(tokenizer_path), timeout
        self._lock = threading.Lock()
        self._process = None
        self._connection = None

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        self._process = context.Process(target=_serve, args=(self.path, theirs), daemon=True)
        self._process.start()
        self._connection = ours
        # The worker loads the tokenizer before its first render.
        if not ours.poll(STARTUP_TIMEOUT) or ours.recv() != "ready":
            self.close()
            raise TemplateTimeout("the template worker did not start")

    def render(self, messages: list[dict[str, Any]], tools, kwargs: dict[str, Any]) -> str:
        """The rendered text; ValueError for the template's own errors, TemplateTimeout when
        it runs too long (the worker is killed)."""
        with self._lock:
            if self._process is None or not self._process.is_alive():
                self._start()
            self._connection.send((messages, tools, kwargs))
            if not self._connection.poll(self.timeout):
                self.close()
                raise TemplateTimeout(f"the chat template ran for over {self.timeout:g} s")
            ok, result = self._connection.recv()
        if not ok:
            raise ValueError(result)
        return result

    def close(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join(timeout=5)
        self._process = self._connection = None
