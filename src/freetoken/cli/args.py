"""The command line's argument checks: every mistake is found while the arguments are parsed
and said in one line that names the flag and what it takes, with exit status 2 and no
traceback. Nothing here imports torch (`ft --help` and a refused flag stay instant)."""

from __future__ import annotations

import argparse
import importlib.util
import math
import re
from collections.abc import Callable
from pathlib import Path

from freetoken import native_preload, packaged_models, settings
from freetoken.config import parse_size

# What --model names besides paths and the packaged models: the random tiny Qwen3-MoE of
# demo.py (the tests' model; offline).
RANDOM_DEMO = "random-demo"


class Parser(argparse.ArgumentParser):
    """argparse, but a mistake is one line on stderr (no usage block), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def integer(low: int | None = None, high: int | None = None) -> Callable[[str], int]:
    """An int within [low, high] (either end open when None)."""
    if high is not None:
        want = f"an integer from {low} to {high}"
    elif low is not None:
        want = {0: "an integer >= 0 (0 turns it off)", 1: "a positive integer"}.get(
            low, f"an integer >= {low}"
        )
    else:
        want = "an integer"

    def check(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expects {want}, got {value!r}") from None
        if (low is not None and n < low) or (high is not None and n > high):
            raise argparse.ArgumentTypeError(f"expects {want}, got {value}")
        return n

    return check


def real(
    low: float | None = None, high: float | None = None, low_open: bool = False, what: str = ""
) -> Callable[[str], float]:
    """A finite float within [low, high] ((low, high] with low_open)."""
    if low is not None and high is not None:
        want = f"a number in {'(' if low_open else '['}{low:g}, {high:g}]"
    elif low is not None:
        want = f"a number {'>' if low_open else '>='} {low:g}"
    else:
        want = "a number"
    want += what

    def check(value: str) -> float:
        try:
            x = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expects {want}, got {value!r}") from None
        if (
            not math.isfinite(x)
            or (low is not None and (x <= low if low_open else x < low))
            or (high is not None and x > high)
        ):
            raise argparse.ArgumentTypeError(f"expects {want}, got {value}")
        return x

    return check


PORT = integer(1, 65535)


def size(value: str) -> str:
    """A count or a byte size (`--moe-cache-size`, `ft ctl cache`): checked, kept as given."""
    try:
        number, _ = parse_size(value)
    except ValueError:
        number = -1.0
    if number <= 0:
        raise argparse.ArgumentTypeError(
            f"expects a positive count (300) or a size (8GiB, 512MB), got {value!r}"
        )
    return value


def size_or_zero(value: str) -> str:
    """`size`, or 0 (`ft ctl cache --experts 0`: no expert cache, every expert from the CPU)."""
    return value if value.strip() == "0" else size(value)


def cuda_problem() -> str | None:
    """Why `--device cuda` cannot run here (asked without importing torch), or None."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return "PyTorch is not installed"
    try:
        text = (Path(spec.origin).parent / "version.py").read_text()
    except OSError:
        text = ""
    cuda = re.search(r"^cuda\s*(?::[^=\n]*)?=\s*(\S+)", text, re.MULTILINE)
    version = re.search(r"^__version__\s*(?::[^=\n]*)?=\s*['\"]([^'\"]+)", text, re.MULTILINE)
    if cuda is not None and cuda[1] == "None":
        v = version[1] if version else "installed"
        return f"this PyTorch ({v}) is a CPU build; install its CUDA build to use a GPU"
    if not native_preload.gpu_driver_present():
        return "no NVIDIA GPU driver is here"
    if settings.gpus_hidden():
        return f"{settings.CUDA_VISIBLE_DEVICES.name} hides every GPU"
    return None


def device(value: str) -> str:
    """`--device`: cpu, cuda or cuda:N, and a GPU only where one can be used."""
    v = value.strip().lower()
    if v == "cpu":
        return v
    if v == "cuda" or re.fullmatch(r"cuda:\d+", v):
        problem = cuda_problem()
        if problem:
            raise argparse.ArgumentTypeError(f"{value}: {problem} (--device cpu runs without)")
        return v
    raise argparse.ArgumentTypeError(f"expects cpu, cuda or cuda:N, got {value!r}")


def model(value: str) -> Path:
    """`--model`: a path that is there (a directory, or a file that is a GGUF file), a packaged
    model's name or the random demo's."""
    path = Path(value)
    if value == RANDOM_DEMO or (packaged_models.lookup(value) and not path.exists()):
        return path
    takes = (
        "give a checkpoint or weight directory, a GGUF file, or a packaged model: "
        f"{', '.join(packaged_models.MODELS)}, {RANDOM_DEMO}"
    )
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{value} does not exist; {takes}")
    if path.is_file():
        try:
            with path.open("rb") as f:
                magic = f.read(4)
        except OSError as e:
            raise argparse.ArgumentTypeError(f"cannot read {value}: {e.strerror}") from None
        if magic != b"GGUF":
            raise argparse.ArgumentTypeError(f"{value} is a file but not a GGUF file; {takes}")
    return path
