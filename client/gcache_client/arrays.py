"""Tensor plumbing: numpy arrays and (optionally) torch tensors as raw byte views.

GCache moves bytes; the layout's dtype only fixes the element size. numpy has no
bfloat16, so bf16 KV travels as ``uint16`` arrays on the numpy side and is viewed
back as ``torch.bfloat16`` for torch callers. torch is imported lazily so an engine
without it (or a tool) never pays for it.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from gcache.errors import LayoutError

NUMPY_DTYPES: dict[str, np.dtype[Any]] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),
    "float8_e4m3fn": np.dtype(np.uint8),
    "float8_e5m2": np.dtype(np.uint8),
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
}


def is_torch(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def to_numpy(x: Any, dtype: str, what: str) -> np.ndarray:
    """A C-contiguous numpy view (or copy, for non-contiguous input) of ``x`` whose
    element size matches ``dtype``. Raises :class:`LayoutError` otherwise."""
    if is_torch(x):
        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        size = t.element_size()
        if str(t.dtype).removeprefix("torch.") != dtype and size != NUMPY_DTYPES[dtype].itemsize:
            raise LayoutError(f"{what}: tensor dtype {t.dtype} does not match layout dtype {dtype}")
        import torch

        int_view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
        arr: np.ndarray = t.view(int_view).numpy()
    else:
        arr = np.ascontiguousarray(x)
    want = NUMPY_DTYPES[dtype].itemsize
    if arr.dtype.itemsize != want:
        raise LayoutError(
            f"{what}: element size {arr.dtype.itemsize} does not match layout dtype "
            f"{dtype} ({want} bytes)"
        )
    return arr


def fills_in_place(user: Any, arr: np.ndarray) -> bool:
    """Whether bytes written into ``arr`` (from :func:`to_numpy`) land in the
    caller's ``user`` buffer itself: not when ``to_numpy`` had to copy (strided or
    non-CPU input), and not for read-only arrays."""
    if is_torch(user):
        return bool(user.device.type == "cpu" and arr.ctypes.data == user.data_ptr())
    return (
        isinstance(user, np.ndarray)
        and user.flags.c_contiguous
        and user.flags.writeable
        and arr.ctypes.data == user.ctypes.data
        and arr.nbytes == user.nbytes
    )


def empty(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    return np.empty(shape, dtype=NUMPY_DTYPES[dtype])


def as_torch(arr: np.ndarray, dtype: str) -> Any:
    """Zero-copy torch view of a numpy array produced by :func:`empty`."""
    import torch

    t = torch.from_numpy(arr)
    if dtype == "bfloat16":
        return t.view(torch.bfloat16)
    if dtype in ("float8_e4m3fn", "float8_e5m2"):
        return t.view(getattr(torch, dtype))
    return t


def byte_view(arr: np.ndarray) -> memoryview:
    return arr.data.cast("B")
