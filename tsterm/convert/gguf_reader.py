"""Reading a llama.cpp GGUF file (all parts of a split one): its metadata, tensor shapes, and each tensor as floats
(the `gguf` package's dequantization) or, for the types tsterm keeps quantized, as `Blocks` (`tsterm.convert.kquant`).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from tsterm.convert.kquant import NATIVE_TYPES, Blocks, to_blocks
from tsterm.errors import ModelLoadError


class GgufFile:
    """Metadata and tensors of one GGUF (all parts of a split one), read lazily from memory maps."""

    def __init__(self, path: Path):
        try:
            from gguf import GGUFReader
        except ImportError:
            raise ModelLoadError("reading GGUF files needs the `gguf` package; install it with: pip install gguf") \
                from None
        self.path = path
        readers = [self._read(path, GGUFReader)]
        parts = self._field(readers[0], "split.count") or 1
        if parts > 1:
            match = re.fullmatch(r"(.*)-(\d{5})-of-(\d{5})\.gguf", path.name)
            if not match or int(match[2]) != 1:
                raise ModelLoadError(f"{path}: part of a {parts}-file split GGUF; pass the first part "
                                     "(...-00001-of-NNNNN.gguf), with the others beside it")
            readers += [self._read(path.with_name(f"{match[1]}-{i:05d}-of-{match[3]}.gguf"), GGUFReader)
                        for i in range(2, parts + 1)]
        self.fields = readers[0].fields
        self.arch = self._field(readers[0], "general.architecture")
        self.tensors = {t.name: t for r in readers for t in r.tensors}

    @staticmethod
    def _read(path: Path, reader_cls):
        if not path.is_file():
            raise ModelLoadError(f"{path}: no such GGUF file")
        try:
            return reader_cls(str(path))
        except Exception as e:  # the reader raises ValueError/struct errors on anything that is not a GGUF
            from tsterm.convert.gguf_extent import truncation
            raise ModelLoadError(truncation(path) or f"{path}: not a readable GGUF file ({e})") from None

    @staticmethod
    def _field(reader, key: str) -> Any:
        field = reader.fields.get(key)
        return None if field is None else field.contents()

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key.format(arch=self.arch))
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"{self.path}: GGUF metadata has no {key.format(arch=self.arch)!r}")
        return value

    def shape(self, name: str) -> tuple[int, ...]:
        """numpy/HF order (GGUF stores dimensions innermost first)."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape))

    def blocks(self, name: str) -> "Blocks | None":
        """A tensor of a `NATIVE_TYPES` type in tsterm's block layout (`tsterm.convert.kquant.to_blocks`); None for
        any other type, and where the result's float16 scales would not be finite (float import instead)."""
        t = self.tensors[name]
        ggml_type = t.tensor_type.name
        native = NATIVE_TYPES.get(ggml_type)
        if native is None:
            return None
        *lead, out_f, in_f = self.shape(name)
        if in_f % native.inputs:  # the GGUF reader refuses such files already; a guard for the reshape below
            raise ModelLoadError(f"{self.path}: tensor {name!r} ({ggml_type}) has rows of {in_f} inputs, not whole "
                                 f"blocks of {native.inputs}")
        raw = np.asarray(t.data).reshape(*lead, out_f, in_f // native.inputs, -1)  # [..., O, blocks, bytes each]
        if raw.shape[-1] != native.nbytes:
            raise ModelLoadError(f"{self.path}: tensor {name!r} ({ggml_type}) has {raw.shape[-1]}-byte blocks, "
                                 f"expected {native.nbytes}")
        return to_blocks(raw, ggml_type, t.tensor_type, in_f)

    def mxfp4(self, name: str) -> tuple[np.ndarray, np.ndarray] | None:
        """An MXFP4 tensor [..., O, I] as (blocks uint8 [..., O, I/32, 16], scales uint8 E8M0 [..., O, I/32]) in
        `tsterm_kernels.quant`'s mxfp4 layout (GGUF's nibble order converted: byte j holds inputs 2j, 2j + 1); None
        for any other type."""
        import torch
        from tsterm_kernels.quant import MX_BLOCK, mxfp4_interleave

        t = self.tensors[name]
        if t.tensor_type.name != "MXFP4":
            return None
        *lead, out_f, in_f = self.shape(name)
        raw = np.asarray(t.data).reshape(*lead, out_f, in_f // MX_BLOCK, -1)  # {uint8 e; uint8 qs[16]} per block
        if raw.shape[-1] != 17:
            raise ModelLoadError(f"{self.path}: tensor {name!r} (MXFP4) has {raw.shape[-1]}-byte blocks, expected 17")
        blocks = mxfp4_interleave(torch.from_numpy(np.ascontiguousarray(raw[..., 1:]))).numpy()
        return blocks, np.ascontiguousarray(raw[..., 0])

    def dequantize(self, name: str) -> np.ndarray:
        from gguf import dequantize

        t = self.tensors[name]
        try:
            values = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ModelLoadError(f"{self.path}: tensor {name!r} has GGML type {t.tensor_type.name}, which cannot "
                                 "be dequantized (re-quantize the model to a common type: Q4_K_M, Q8_0, F16)") from None
        return values.reshape(self.shape(name))
