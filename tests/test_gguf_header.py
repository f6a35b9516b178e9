"""A GGUF file judged from its header before any conversion (models/gguf_header.py): an
architecture freetoken does not serve refused at once, naming it and those served; a file cut
short or not GGUF in one line. Tiny files written by the gguf package; about 3 s."""

from __future__ import annotations

import time

import numpy as np
import pytest

from freetoken import settings
from freetoken.errors import CheckpointError, UnsupportedModelError
from freetoken.models import gguf, gguf_header


def write(path, arch: str = "qwen2", endian: str = "LITTLE", tensors: int = 3):
    """A GGUF file of `arch`: metadata of every kind the walk steps over (strings, string and
    integer arrays, an array of arrays) and `tensors` tensors, F32 and Q8_0."""
    import gguf as gguf_package

    w = gguf_package.GGUFWriter(str(path), arch, endianess=getattr(gguf_package.GGUFEndian, endian))
    w.add_name("tiny")
    w.add_block_count(2)
    w.add_token_list([f"tok{i}" * (i % 7) for i in range(500)])
    w.add_token_types([1] * 500)
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_float32("test.scale", 0.5)
    w.add_bool("test.flag", True)
    rng = np.random.default_rng(0)
    for i in range(tensors):
        data = rng.standard_normal((4, 64)).astype(np.float32)
        if i % 2:
            data = gguf_package.quants.quantize(data, gguf_package.GGMLQuantizationType.Q8_0)
            w.add_tensor(f"blk.{i}.w", data, raw_dtype=gguf_package.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(f"blk.{i}.w", data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("endian", ["LITTLE", "BIG"])
def test_the_walk_reads_what_the_gguf_package_reads(tmp_path, endian):
    import gguf as gguf_package

    path = write(tmp_path / "m.gguf", endian=endian)
    header = gguf_header.read(path)
    reader = gguf_package.GGUFReader(str(path))
    assert header.architecture == "qwen2" and header.metadata["general.name"] == "tiny"
    assert header.tensor_types == {t.name: int(t.tensor_type) for t in reader.tensors}
    assert len(header.tensor_types) == 3
    assert header.data_end == max(t.data_offset + t.n_bytes for t in reader.tensors)
    assert header.data_end <= header.file_size


def test_an_unsupported_architecture_is_refused_at_once_without_converting(tmp_path, monkeypatch):
    monkeypatch.setenv(settings.CACHE_DIR.name, str(tmp_path / "cache"))
    monkeypatch.setattr(gguf, "_convert", lambda *a: pytest.fail("converted"))
    path = write(tmp_path / "mamba.gguf", arch="mamba")
    begun = time.perf_counter()
    with pytest.raises(UnsupportedModelError) as e:
        gguf.checkpoint_of(path)
    assert time.perf_counter() - begun < 1.0
    assert str(e.value) == (
        "mamba.gguf holds a model of GGUF architecture mamba, which freetoken does not serve; "
        "GGUF architectures served: gpt-oss, llama, qwen2, qwen2moe, qwen3, qwen3moe"
    )
    assert not any((tmp_path / "cache" / "gguf").glob("*"))


def test_the_architectures_served_are_those_transformers_converts():
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    renamed = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss"}
    for arch in gguf_header.CONVERTED:
        assert renamed.get(arch, arch) in GGUF_SUPPORTED_ARCHITECTURES, arch
    assert gguf_header.served() == ["gpt-oss", "llama", "qwen2", "qwen2moe", "qwen3", "qwen3moe"]


def test_a_file_cut_short_in_its_tensors_is_truncated(tmp_path, monkeypatch):
    monkeypatch.setenv(settings.CACHE_DIR.name, str(tmp_path / "cache"))
    path = write(tmp_path / "cut.gguf")
    end = gguf_header.read(path).data_end
    with open(path, "r+b") as f:
        f.truncate(end - 10)
    with pytest.raises(CheckpointError) as e:
        gguf.checkpoint_of(path)
    assert str(e.value) == (
        f"cut.gguf is truncated: {end - 10:,} bytes, but its tensors' data ends at {end:,} "
        "(an interrupted download or copy?)"
    )


def test_a_file_cut_short_in_its_header_is_truncated(tmp_path):
    path = write(tmp_path / "cut.gguf")
    with open(path, "r+b") as f:
        f.truncate(2000)  # (inside the token list)
    with pytest.raises(CheckpointError, match=r"^cut\.gguf is truncated or damaged: its header"):
        gguf_header.read(path)


def test_a_file_that_is_not_gguf_says_how_it_begins(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04 a zip")
    with pytest.raises(CheckpointError, match=r"^x\.gguf is not a GGUF file: it begins b'PK"):
        gguf_header.read(path)


def test_the_cli_refuses_an_unsupported_gguf_in_one_line(tmp_path, monkeypatch, capsys):
    from freetoken.cli.main import main

    monkeypatch.setenv(settings.CACHE_DIR.name, str(tmp_path / "cache"))
    path = write(tmp_path / "bad.gguf", arch="mamba")
    code = main(["generate", "--model", str(path), "--prompt", "hi", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines() == [
        "error: bad.gguf holds a model of GGUF architecture mamba, which freetoken does not "
        "serve; GGUF architectures served: gpt-oss, llama, qwen2, qwen2moe, qwen3, qwen3moe"
    ]
