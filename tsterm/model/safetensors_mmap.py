"""Zero-copy safetensors reader: every tensor is a view of the memory-mapped file, read by the OS on first touch."""
from __future__ import annotations

import json
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
                raise ModelLoadError(f"{path}: truncated safetensors file (no header)")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > size - 8:
                raise ModelLoadError(f"{path}: truncated or corrupt safetensors file (header length {header_len} "
                                     f"exceeds the file size {size})")
            try:
                header = json.loads(f.read(header_len))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ModelLoadError(f"{path}: corrupt safetensors header ({e})") from None
            # ACCESS_COPY: a private mapping, so torch gets a writable buffer without ever writing the file.
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size > 0 else None
        header.pop("__metadata__", None)
        self._data_start = 8 + header_len
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            dtype = DTYPES.get(info.get("dtype"))
            if dtype is None:
                raise ModelLoadError(f"{path}: tensor {name!r} has unsupported dtype {info.get('dtype')!r}")
            begin, end = info["data_offsets"]
            shape = tuple(info["shape"])
            if self._data_start + end > size:
                raise ModelLoadError(f"{path}: truncated file: tensor {name!r} ends at byte {self._data_start + end} "
                                     f"but the file has {size} bytes (re-download it)")
            numel = 1
            for d in shape:
                numel *= d
            if (end - begin) != numel * torch.empty((), dtype=dtype).element_size():
                raise ModelLoadError(f"{path}: tensor {name!r}: byte length does not match shape {list(shape)}")
            self.entries[name] = (dtype, shape, begin, end)

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
