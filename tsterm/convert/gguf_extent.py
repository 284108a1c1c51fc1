"""What a GGUF file's header promises, checked against the file's size: a truncated download is named by the first
tensor it cuts and the bytes it lacks, instead of the reader's "cannot reshape array".

A GGUF file is: magic, version, tensor count, metadata count; the metadata (key, type, value); one record per
tensor (name, dimensions, GGML type, offset into the data section); padding to the alignment; the data section.
Read here with plain `struct` over the file's bytes, never past its end, so it answers for any cut; the `gguf`
package's reader (used for everything else) maps every tensor as it opens the file and fails on the first short one.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

DEFAULT_ALIGNMENT = 32
# GGUF metadata value types -> struct format of a scalar (8: string, 9: array, handled apart)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
MAX_COUNT = 1 << 24  # more tensors or metadata entries than any model has: a garbled header


class Cut(Exception):
    """The header ends before `what` could be read."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


@dataclass(frozen=True)
class TensorExtent:
    name: str
    ggml_type: str
    shape: tuple[int, ...]  # numpy / HF order
    start: int  # absolute byte offset of its data in the file
    nbytes: int

    @property
    def end(self) -> int:
        return self.start + self.nbytes


class _Cursor:
    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def take(self, fmt: str, what: str) -> tuple:
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.data):
            raise Cut(what)
        values = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += size
        return values

    def string(self, what: str) -> str:
        (length,) = self.take("Q", what)
        if self.pos + length > len(self.data):
            raise Cut(what)
        text = self.data[self.pos:self.pos + length].decode("utf-8", errors="replace")
        self.pos += length
        return text

    def value(self, kind: int, what: str):
        if kind == STRING:
            return self.string(what)
        if kind == ARRAY:
            item_kind, count = self.take("IQ", what)
            if item_kind in SCALARS:  # skipped whole: a 49k-token vocabulary's scores need no loop
                size = struct.calcsize("<" + SCALARS[item_kind]) * count
                if self.pos + size > len(self.data):
                    raise Cut(what)
                self.pos += size
                return None
            return [self.value(item_kind, what) for _ in range(count)]
        if kind not in SCALARS:
            raise ValueError(f"unknown metadata value type {kind} in {what}")
        return self.take(SCALARS[kind], what)[0]


def tensor_extents(header: bytes) -> list[TensorExtent]:
    """Every tensor's byte range, from the file's leading bytes (Cut if they end inside the header)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    cursor = _Cursor(header)
    magic, version = cursor.take("4sI", "the magic and version")
    tensor_count, kv_count = cursor.take("QQ", "the tensor and metadata counts")
    if magic != b"GGUF" or version not in (2, 3) or max(tensor_count, kv_count) > MAX_COUNT:
        raise ValueError("not a GGUF header")  # a garbled file, not a cut one: the reader's error says more
    alignment = DEFAULT_ALIGNMENT
    for i in range(kv_count):
        key = cursor.string(f"metadata entry {i + 1} of {kv_count}")
        (kind,) = cursor.take("I", f"metadata {key!r}")
        value = cursor.value(kind, f"metadata {key!r}")
        if key == "general.alignment" and isinstance(value, int) and value > 0:
            alignment = value
    records = []
    for i in range(tensor_count):
        name = cursor.string(f"tensor record {i + 1} of {tensor_count}")
        (n_dims,) = cursor.take("I", f"tensor record {name!r}")
        dims = cursor.take(f"{n_dims}Q", f"tensor record {name!r}")
        raw_type, offset = cursor.take("IQ", f"tensor record {name!r}")
        records.append((name, dims, raw_type, offset))
    data_start = -(-cursor.pos // alignment) * alignment
    extents = []
    for name, dims, raw_type, offset in records:
        ggml_type = GGMLQuantizationType(raw_type)
        block, block_bytes = GGML_QUANT_SIZES[ggml_type]
        elements = 1
        for d in dims:
            elements *= d
        extents.append(TensorExtent(name, ggml_type.name, tuple(reversed(dims)), data_start + offset,
                                    elements // block * block_bytes))
    return extents


HEADER_READ = 64 << 20  # enough for any real header (a 150k-token vocabulary's metadata is a few MB)


def truncation(path: Path) -> str | None:
    """What `path` lacks, if its header promises more bytes than it has; None for a whole file (or one this
    check cannot read: the caller reports the reader's own error)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        header = f.read(HEADER_READ)
    try:
        extents = tensor_extents(header)
    except Cut as cut:
        if len(header) < size:  # a header beyond HEADER_READ: not a cut this check can see
            return None
        return (f"{path}: the file is cut short: it has {size:,} bytes and ends inside its header ({cut.what}); "
                "download or copy it again")
    except (ValueError, KeyError, struct.error):
        return None
    cut = sorted((t for t in extents if t.end > size), key=lambda t: t.start)
    if not cut:
        return None
    first, need = cut[0], max(t.end for t in extents)
    shape = " x ".join(map(str, first.shape))
    have = max(0, size - first.start)
    after = len(cut) - 1  # they start past the end: missing whole
    rest = f", and the {after} tensor{'s' if after != 1 else ''} after it are missing" if after else ""
    return (f"{path}: the file is cut short: it has {size:,} bytes, its {len(extents)} tensors need {need:,} "
            f"({need - size:,} missing); tensor {first.name!r} ({first.ggml_type}, {shape}) has {have:,} of its "
            f"{first.nbytes:,} bytes{rest}; download or copy it again")
