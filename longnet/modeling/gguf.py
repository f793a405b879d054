"""GGUF files checked before ``transformers`` reads them (which fails without naming the file):
the header is read here, without the ``gguf`` package."""

from __future__ import annotations

import struct
from math import prod
from pathlib import Path
from typing import IO, Any

from longnet.validation import UsageError

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
"""The GGUF versions whose layout :func:`check_gguf_file` reads (``gguf`` reads only these)."""
GGUF_DEFAULT_ALIGNMENT = 32
GGUF_REFETCH = "download it again (or copy it whole)"
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
                 11: "q", 12: "d"}
"""GGUF metadata value types of fixed size and their ``struct`` formats."""
_GGUF_STRING, _GGUF_ARRAY = 8, 9
GGML_BLOCKS = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
    9: (32, 40), 10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176),
    14: (256, 210), 15: (256, 292), 16: (256, 66), 17: (256, 74), 18: (256, 98),
    19: (256, 50), 20: (32, 18), 21: (256, 110), 22: (256, 82), 23: (256, 136), 24: (1, 1),
    25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8), 29: (256, 56), 30: (1, 2),
    34: (256, 54), 35: (256, 66), 39: (32, 17), 40: (64, 36), 41: (128, 18),
}
"""``{ggml type: (values per block, bytes per block)}``; other types are not size-checked."""


class _GGUFHeader:
    """Reads a GGUF header in order; a read past the end is a :class:`UsageError`."""

    def __init__(self, path: Path, handle: IO[bytes], size: int) -> None:
        self.path, self.handle, self.size = path, handle, size
        self.order = "<"

    def need(self, count: int, what: str) -> int:
        """Where the next ``count`` bytes, holding ``what``, start; refused past the end."""
        start = self.handle.tell()
        if start + count > self.size:
            raise UsageError(
                f"{self.path} is truncated at byte {self.size:,}: its {what} needs {count:,} "
                f"bytes from byte {start:,} (an interrupted download or copy?); "
                f"{GGUF_REFETCH}.")
        return start

    def take(self, count: int, what: str) -> bytes:
        """The next ``count`` bytes, holding ``what``."""
        self.need(count, what)
        return self.handle.read(count)

    def skip(self, count: int, what: str) -> None:
        """Move past the next ``count`` bytes, holding ``what``."""
        self.handle.seek(self.need(count, what) + count)

    def unpack(self, fmt: str, what: str) -> Any:
        """The next value of the ``struct`` format ``fmt`` (one letter), holding ``what``."""
        return struct.unpack(self.order + fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        """The next GGUF string (a uint64 length, then UTF-8 bytes)."""
        length = self.unpack("Q", f"{what} (its length)")
        return self.take(length, what).decode("utf-8", errors="replace")

    def value(self, kind: int, key: str) -> Any:
        """The next metadata value of type ``kind`` (``key``'s); arrays are skipped (None)."""
        if kind in _GGUF_SCALARS:
            return self.unpack(_GGUF_SCALARS[kind], f"metadata value {key!r}")
        if kind == _GGUF_STRING:
            return self.string(f"metadata value {key!r}")
        if kind != _GGUF_ARRAY:
            raise UsageError(
                f"{self.path} is corrupt: its metadata value {key!r} has type {kind}, which GGUF "
                f"does not define; {GGUF_REFETCH}.")
        item = self.unpack("I", f"metadata array {key!r} (its type)")
        count = self.unpack("Q", f"metadata array {key!r} (its length)")
        if item in _GGUF_SCALARS:
            self.skip(count * struct.calcsize(_GGUF_SCALARS[item]), f"metadata array {key!r}")
        else:
            for _ in range(count):
                self.value(item, key)
        return None


def check_gguf_file(path: str | Path) -> None:
    """Refuse a GGUF file whose header or tensor data cannot be read whole.

    Raises:
        UsageError: empty, not GGUF, a version not in :data:`GGUF_VERSIONS`, or truncated.
    """
    path = Path(path)
    size = path.stat().st_size
    if size == 0:
        raise UsageError(f"{path} is empty (0 bytes), not a GGUF model (an interrupted download "
                         f"or copy?); {GGUF_REFETCH}.")
    with path.open("rb") as handle:
        header = _GGUFHeader(path, handle, size)
        _check_gguf_start(header)
        tensor_count = header.unpack("Q", "tensor count")
        alignment = _gguf_alignment(header, header.unpack("Q", "metadata count"))
        tensors = [_gguf_tensor(header) for _ in range(tensor_count)]
        data_start = -(-handle.tell() // alignment) * alignment
    _check_gguf_tensor_data(path, size, data_start, tensors)


def _check_gguf_start(header: _GGUFHeader) -> None:
    """Read the magic and version (and so the byte order); refuse an unreadable one."""
    magic = header.handle.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC[:len(magic)]:
        raise UsageError(f"{header.path} is not a GGUF file: it starts with {magic!r}, not "
                         f"{GGUF_MAGIC!r}; give a .gguf model file, or {GGUF_REFETCH}.")
    header.handle.seek(0)
    header.take(len(GGUF_MAGIC), "magic number")
    raw = header.take(4, "version")
    version = struct.unpack("<I", raw)[0]
    if version & 0xFFFF == 0:  # written big-endian
        header.order, version = ">", struct.unpack(">I", raw)[0]
    if version not in GGUF_VERSIONS:
        raise UsageError(
            f"{header.path} is GGUF version {version}; versions "
            f"{' and '.join(map(str, GGUF_VERSIONS))} can be read: convert the model again "
            "with a current llama.cpp (convert_hf_to_gguf.py).")


def _gguf_alignment(header: _GGUFHeader, count: int) -> int:
    """Read the ``count`` metadata entries; the data's alignment (``general.alignment``)."""
    alignment = GGUF_DEFAULT_ALIGNMENT
    for index in range(count):
        key = header.string(f"metadata key {index}")
        value = header.value(header.unpack("I", f"metadata type of {key!r}"), key)
        if key == "general.alignment" and isinstance(value, int) and value > 0:
            alignment = value
    return alignment


def _gguf_tensor(header: _GGUFHeader) -> tuple[str, int | None, int]:
    """Read one tensor description: name, data size in bytes (None: unknown type), offset."""
    name = header.string("tensor name")
    dims = header.unpack("I", f"tensor {name!r} (its number of dimensions)")
    shape = [header.unpack("Q", f"tensor {name!r} (its shape)") for _ in range(dims)]
    kind = header.unpack("I", f"tensor {name!r} (its type)")
    offset = header.unpack("Q", f"tensor {name!r} (its offset)")
    block = GGML_BLOCKS.get(kind)
    nbytes = None if block is None else -(-prod(shape) // block[0]) * block[1]
    return name, nbytes, offset


def _check_gguf_tensor_data(path: Path, size: int, data_start: int,
                            tensors: list[tuple[str, int | None, int]]) -> None:
    """Refuse, naming the first such tensor, tensor data that ends past the file's end."""
    ends = [(data_start + offset + (nbytes or 0), name, nbytes, data_start + offset)
            for name, nbytes, offset in tensors]
    past = [end for end in ends if end[0] > size]
    if not past:
        return
    _, name, nbytes, start = min(past, key=lambda end: end[3])
    needed = max(end[0] for end in ends)
    raise UsageError(
        f"{path} is truncated: tensor {name!r} needs {nbytes or 0:,} bytes from byte {start:,}, "
        f"the file has {size:,} (a complete file has at least {needed:,} bytes; an "
        f"interrupted download or copy?); {GGUF_REFETCH}.")
