"""The release's weights file on disk: `model.safetensors` read one tensor at a time through a memory map.

`SafetensorsFile` parses the header itself (so a truncated or inconsistent file is named before a byte of
weights is read) and hands out zero-copy views of the mapped file; `drop` returns a range's pages to the
kernel once they are copied, so reading the whole file never holds it resident. Knows the file format; knows
nothing of the config beside it (engine/model/release_config.py), of modules, devices or the engine.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

WEIGHTS_FILE = "model.safetensors"

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_PAGE = mmap.PAGESIZE


class CheckpointError(ValueError):
    """The checkpoint is missing, unreadable, or does not match the preset."""


def weights_path(path: str | Path) -> Path:
    """A checkpoint folder (with model.safetensors) or the file itself."""
    p = Path(path)
    if p.is_dir():
        p = p / WEIGHTS_FILE
    if not p.is_file():
        raise CheckpointError(f"checkpoint: no {WEIGHTS_FILE} at {str(path)!r}")
    return p


@dataclass(frozen=True)
class TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class SafetensorsFile:
    """A safetensors file, memory-mapped; `view(name)` is a tensor over the mapped bytes (no copy)."""

    def __init__(self, path: str | Path) -> None:
        self.path = weights_path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(
                    f"checkpoint: cannot read {self.path}: not a safetensors file ({size} bytes)"
                )
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, 100 * 2**20):
                raise CheckpointError(
                    f"checkpoint: cannot read {self.path}: not a safetensors file, or truncated "
                    f"in its header (header of {n} bytes, file of {size})"
                )
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise CheckpointError(
                    f"checkpoint: cannot read {self.path}: unreadable header: {e}"
                ) from None
        if not isinstance(header, dict):
            raise CheckpointError(f"checkpoint: {self.path} has an unreadable header")
        self.metadata = header.pop("__metadata__", None) or {}
        base = 8 + n
        self.tensors: dict[str, TensorInfo] = {}
        data_end = 0
        for name, h in header.items():
            try:
                dtype = _DTYPES[h["dtype"]]
                shape = tuple(int(d) for d in h["shape"])
                a, b = (int(x) for x in h["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(
                    f"checkpoint: {self.path}: tensor {name!r} has a bad header entry {h}"
                ) from None
            want = math.prod(shape) * dtype.itemsize
            if b - a != want:
                raise CheckpointError(
                    f"checkpoint: {self.path}: tensor {name!r} {h['dtype']}{list(shape)} needs {want} bytes, "
                    f"the header gives it {b - a}"
                )
            self.tensors[name] = TensorInfo(dtype, shape, base + a, base + b)
            data_end = max(data_end, base + b)
        if size < data_end:
            raise CheckpointError(
                f"checkpoint: {self.path} is truncated: its header describes {data_end:,} bytes, "
                f"the file has {size:,} ({(data_end - size) / 2**30:.2f} GiB missing; download it again)"
            )
        self.size = size
        self._file = open(self.path, "rb")  # noqa: SIM115 (closed by close())
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if size else None

    def view(self, name: str) -> torch.Tensor:
        """The tensor as stored, over the mapped file (read-only: copy it out, never write to it)."""
        info = self.tensors[name]
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=info.dtype)
        with warnings.catch_warnings():  # the map is read-only; the views are only ever read from
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(
                self._map, dtype=info.dtype, count=info.nbytes // info.dtype.itemsize, offset=info.start
            )
        return flat.view(info.shape)

    def drop(self, start: int, end: int) -> None:
        """Let the kernel reclaim the mapped pages of
        [start, end) (they stay in the page cache, not in us)."""
        if self._map is None or end <= start:
            return
        a = start // _PAGE * _PAGE
        b = min(-(-end // _PAGE) * _PAGE, self.size)
        if hasattr(mmap, "MADV_DONTNEED") and b > a:
            self._map.madvise(mmap.MADV_DONTNEED, a, b - a)

    def close(self) -> None:
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a view is still alive somewhere: the map goes with it
                self._map.close()
            self._map = None
        self._file.close()

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_header_only(path: str | Path, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> int:
    """A safetensors file whose data is all zeros and costs no disk (a sparse file): the header, then a
    hole as long as the data. Returns the file's size. For synthetic checkpoints of any size."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (shape, dtype) in shapes.items():
        n = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return 8 + len(raw) + offset
