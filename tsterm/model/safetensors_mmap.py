"""Safetensors files through `safetensors.safe_open`: every tensor is a view of a private mapping of the file.

`safe_open(path, framework="pt")` maps the whole file once (`torch.UntypedStorage.from_file(..., shared=False)`,
a MAP_PRIVATE `rw-p` mapping in /proc/self/maps) and `get_tensor` returns a view of that storage: nothing is read
until a page is touched, a write never reaches the file, and the view outlives the handle. Measured with
safetensors 0.8.0 / torch 2.13 CPU on a 384 MiB F32 tensor, page cache dropped before each run (3 runs):

    reader                          open + get   RssAnon after get   tensor in the file mapping   2 gets, 1 buffer
    own mmap + frombuffer (before)  1-6 ms       +0 MiB              yes                          yes
    safe_open().get_tensor          6-11 ms      +0 MiB              yes                          yes
    safe_open().get_slice(...)[:]   6-12 ms      +0 MiB              yes                          yes
    safetensors.torch.load_file     19-22 ms     +0 MiB              yes                          no (maps per call)
    safetensors.torch.load(bytes)   2.8-3.8 s    +384 MiB per call   no (copies out of bytes)     no

Touching every page afterwards (`sum()`) took 0.2-0.7 s for all the mapped readers alike (disk-bound, RssFile
+385 MiB, RssAnon +0). So tsterm reads weights through `safe_open` + `get_tensor`: still zero-copy, and safetensors
parses and checks the header (overlapping or gapped offsets, bytes past the last tensor, sizes that do not match
shape x dtype) and knows every dtype, FP8 included. Its messages do not always name the tensor or say what to do,
so only after it refused a file does `_explain` read the header again to name the file, the tensor and the fix.
"""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from tsterm.errors import ModelLoadError

# dtypes tsterm loads as weights (converted to the engine's dtype): safetensors name -> torch dtype
WEIGHT_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class SafetensorsFile:
    """One `.safetensors` file, opened (and mapped) once. `tensor(name)` is a view of the mapping: no read, no copy."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self._file = safe_open(path, framework="pt", device="cpu")
        except SafetensorError as e:
            raise ModelLoadError(_explain(path, str(e))) from None
        except OSError as e:
            raise ModelLoadError(f"{path}: cannot read this weights file ({e.strerror or e})") from None

    def keys(self) -> list[str]:
        return list(self._file.keys())

    def tensor(self, name: str) -> torch.Tensor:
        return self._file.get_tensor(name)

    def dtype_name(self, name: str) -> str:
        return self._file.get_slice(name).get_dtype()  # the header's name: "BF16", "F8_E4M3", ...

    def nbytes(self, name: str) -> int:
        return self.tensor(name).nbytes


def _explain(path: Path, reason: str) -> str:
    """A one-line message for a file safetensors refused: which tensor, what is wrong, what to do."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{path}: truncated safetensors file (no header); re-download it"
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8:
            return (f"{path}: truncated or corrupt safetensors file (header length {header_len} exceeds the file "
                    f"size {size}); re-download it")
        try:
            header = json.loads(f.read(header_len))
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
            return f"{path}: corrupt safetensors header ({e}); re-download it"
    if not isinstance(header, dict):
        return f"{path}: corrupt safetensors header (a JSON {type(header).__name__}, not an object); re-download it"
    spans: list[tuple[int, int, str]] = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or not isinstance(info.get("dtype"), str) or not _sizes(info.get("shape")) \
                or not _sizes(info.get("data_offsets")) or len(info["data_offsets"]) != 2:
            return (f"{path}: corrupt safetensors header: entry for tensor {name!r} needs dtype, shape and "
                    f"data_offsets [begin, end], got {info!r}; re-download it")
        dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        if f"`{dtype}`" in reason:  # serde's "unknown variant `F8_E9M9`"
            return (f"{path}: tensor {name!r} has dtype {dtype!r}, which this safetensors cannot read (tsterm loads "
                    f"{', '.join(WEIGHT_DTYPES)}); convert the checkpoint to one of those")
        need = math.prod(shape) * WEIGHT_DTYPES[dtype].itemsize if dtype in WEIGHT_DTYPES else end - begin
        if end - begin != need or end < begin:
            return (f"{path}: corrupt safetensors header: tensor {name!r} spans data bytes [{begin}, {end}), not the "
                    f"{need} bytes its shape {shape} and dtype {dtype} take; re-download it")
        if 8 + header_len + end > size:
            return (f"{path}: truncated file: tensor {name!r} ends at byte {8 + header_len + end} but the file has "
                    f"{size} bytes (re-download it)")
        spans.append((begin, end, name))
    data_end = 0
    for begin, end, name in sorted(spans):
        if begin != data_end:
            return (f"{path}: corrupt safetensors header: tensor {name!r} starts at data byte {begin}, where the "
                    f"previous tensor ends at {data_end} (overlapping or gapped tensors); re-download it")
        data_end = end
    if 8 + header_len + data_end < size:
        return (f"{path}: corrupt safetensors file: {size - 8 - header_len - data_end} bytes after its last tensor "
                "that no header entry describes; re-download it")
    return f"{path}: corrupt safetensors file ({reason}); re-download it"


def _sizes(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
