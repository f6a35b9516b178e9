"""Running a test module's Triton cases on the CPU under Triton's interpreter: TRITON_INTERPRET
must be set before triton is imported, so the cases run in one subprocess and return their
results as JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def run_interpreted(module: str, function: str, *args, timeout: float = 600):
    """`module.function(*args)` (a test module's, returning JSON-able data; `args` written as
    their reprs) in a subprocess under the interpreter."""
    call = f"m.{function}({', '.join(map(repr, args))})"
    code = (
        f"import json, sys; sys.path.insert(0, sys.argv[1]); import {module} as m; "
        f"print(json.dumps({call}))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(TESTS)],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
