"""Zero-copy safetensors reader: every tensor is a view of the memory-mapped file, read by the OS on first touch."""
from __future__ import annotations

import json
import math
import mmap
import struct
from pathlib import Path

import torch

from tsterm.errors import ModelLoadError

DTYPES = {
    "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class SafetensorsFile:
    """One `.safetensors` file, mapped once. `tensor(name)` returns a view of the mapping (no read, no copy)."""

    def __init__(self, path: Path):
        self.path = path
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelLoadError(f"{path}: truncated safetensors file (no header); re-download it")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > size - 8:
                raise ModelLoadError(f"{path}: truncated or corrupt safetensors file (header length {header_len} "
                                     f"exceeds the file size {size}); re-download it")
            try:
                header = json.loads(f.read(header_len))
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
                raise ModelLoadError(f"{path}: corrupt safetensors header ({e}); re-download it") from None
            if not isinstance(header, dict):
                raise ModelLoadError(f"{path}: corrupt safetensors header (a JSON {type(header).__name__}, "
                                     "not an object); re-download it")
            # ACCESS_COPY: a private mapping, so torch gets a writable buffer without ever writing the file.
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size > 0 else None
        header.pop("__metadata__", None)
        self._data_start = 8 + header_len
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            self.entries[name] = self._parse_entry(name, info, size)

    def _parse_entry(self, name: str, info: object, size: int) -> tuple[torch.dtype, tuple[int, ...], int, int]:
        path = self.path
        if not isinstance(info, dict) or not _is_ints(info.get("shape")) or not _is_ints(info.get("data_offsets")) \
                or len(info["data_offsets"]) != 2:
            raise ModelLoadError(f"{path}: corrupt safetensors header: entry for tensor {name!r} needs dtype, "
                                 f"shape and data_offsets [begin, end], got {info!r}")
        dtype = DTYPES.get(info["dtype"]) if isinstance(info.get("dtype"), str) else None
        if dtype is None:
            raise ModelLoadError(f"{path}: tensor {name!r} has unsupported dtype {info.get('dtype')!r} "
                                 f"(supported: {', '.join(DTYPES)})")
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if not 0 <= begin <= end or min(shape, default=0) < 0:
            raise ModelLoadError(f"{path}: corrupt safetensors header: tensor {name!r} has offsets "
                                 f"[{begin}, {end}] and shape {list(shape)}")
        if self._data_start + end > size:
            raise ModelLoadError(f"{path}: truncated file: tensor {name!r} ends at byte {self._data_start + end} "
                                 f"but the file has {size} bytes (re-download it)")
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise ModelLoadError(f"{path}: corrupt safetensors header: tensor {name!r} has {end - begin} bytes, "
                                 f"which does not match its shape {list(shape)} and dtype {info['dtype']}")
        return dtype, shape, begin, end

    def keys(self) -> list[str]:
        return list(self.entries)

    def tensor(self, name: str) -> torch.Tensor:
        dtype, shape, begin, end = self.entries[name]
        if end == begin:
            return torch.empty(shape, dtype=dtype)
        flat = torch.frombuffer(self._map, dtype=dtype, count=(end - begin) // dtype.itemsize,
                                offset=self._data_start + begin)
        return flat.view(shape)

    def nbytes(self, name: str) -> int:
        _, _, begin, end = self.entries[name]
        return end - begin


def _is_ints(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
