"""Compiling a test module's Triton launches for the GPU on a machine that has none.

CI has no GPU. The interpreter (interpreted.py) runs the kernels' arithmetic on the CPU, but
not Triton's code generator nor ptxas, and a kernel the interpreter takes can fail to compile
(paired K-quant tiles did: a helper returning tiles of two shapes under a constexpr branch).
Here a module's function runs in a subprocess whose Triton driver compiles each launch for an
H200 (sm_90, ptxas from Triton's wheel) as the GPU machine would, and launches nothing: the
outputs are left unwritten, what the function returns is what it saw compile.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SM90_SHARED = 232448  # bytes of shared memory a block may take on an H100/H200

# Kernels compiled in the subprocess, in order: name, warps, shared memory bytes.
COMPILED: list[dict] = []


def install() -> None:
    """Make Triton's active driver the compile-only one (in the subprocess)."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase
    from triton.runtime.driver import driver

    class Utils:
        @staticmethod
        def get_device_properties(device):
            return {"max_shared_mem": SM90_SHARED, "multiprocessor_count": 132}

        @staticmethod
        def load_binary(name, kernel, shared, device):
            return None, None, 0, 0, 1024  # (module, function, registers, spills, threads)

    class CompileOnly(DriverBase):
        utils = Utils()

        @classmethod
        def is_active(cls):
            return True

        def launcher_cls(self, src, metadata):
            COMPILED.append(
                dict(name=metadata.name, warps=metadata.num_warps, shared=metadata.shared)
            )
            return lambda *args: None

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

        def map_python_to_cpp_type(self, ty):
            raise NotImplementedError

        def get_benchmarker(self):
            raise NotImplementedError

        def get_device_interface(self):
            raise NotImplementedError

        def get_empty_cache_for_benchmark(self):
            raise NotImplementedError

        def clear_cache(self, cache):
            raise NotImplementedError

    driver.set_active(CompileOnly())


def run_compiled(module: str, function: str, *args, timeout: float = 900):
    """`module.function(*args)` (a test module's, returning JSON-able data; `args` written as
    their reprs) in a subprocess whose Triton compiles for sm_90 and launches nothing."""
    call = f"m.{function}({', '.join(map(repr, args))})"
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import compiled; "
        f"compiled.install(); import {module} as m; print(json.dumps({call}))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(TESTS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
