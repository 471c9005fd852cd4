"""Hand a checkpoint's state from the work's thread to the supervisor for
the price of a copy.

``torch.save`` spends most of its time on small states in Python, once per
pickled object (~0.6 ms for the example's 17 tensors; 5% of its 15 ms
epoch), all of it on the training thread and under the GIL, so a thread of
the work's process cannot take it over.  :func:`write` therefore stores the
state as raw tensor bytes plus a pickled skeleton of everything else
(~0.2 ms for the same state); the supervisor's process turns it into a
regular ``torch.save`` file with :func:`read` when it commits the
checkpoint (:func:`tasks.checkpoints.commit`).  The committed format is
torch's own; this one lives only inside an uncommitted ``step-<N>/``.

Only states whose every tensor is a plain, dense, contiguous tensor owning
its whole storage, none sharing storage with another, are handed over this
way (what ``state_dict()`` gives); for anything else :func:`write` raises
:class:`NotHandedOver` and the caller falls back to ``torch.save``, so
what loads back is always exactly what ``torch.save`` would have kept.

File layout: ``MAGIC``, the header's length (8 bytes, little-endian), the
header (pickle of ``{"skeleton": bytes, "tensors": [(dtype name, shape,
requires_grad, nbytes), ...]}``), then each tensor's bytes at a 64-byte
aligned offset.  :func:`read` unpickles with an allow-list (containers,
numbers, strings, ``torch.Size``, dtypes, devices): never arbitrary code.
"""

from __future__ import annotations

import collections
import io
import pickle
from pathlib import Path
from typing import Any, BinaryIO

MAGIC = b"E31STATE1\n"
_ALIGN = 64


class NotHandedOver(Exception):
    """The state holds a tensor this format does not keep exactly (a view,
    a shared storage, a subclass such as ``nn.Parameter``, a sparse or
    quantized tensor): save it with ``torch.save`` instead."""


class _Pickler(pickle.Pickler):
    def __init__(self, fh: BinaryIO, tensors: list):
        super().__init__(fh, protocol=pickle.HIGHEST_PROTOCOL)
        self._tensors = tensors
        self._storages: set[int] = set()

    def persistent_id(self, obj: Any) -> Any:
        import torch

        if not isinstance(obj, torch.Tensor):
            return None
        if type(obj) is not torch.Tensor or obj.layout != torch.strided or obj.is_quantized:
            raise NotHandedOver(f"a {type(obj).__name__} with layout {obj.layout}")
        if not (obj.is_contiguous() and obj.storage_offset() == 0 and obj.untyped_storage().nbytes() == obj.nbytes):
            raise NotHandedOver("a view of a larger storage")
        t = obj.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")  # written as a CPU tensor, as loading with map_location="cpu" gives it back
        ptr = obj.untyped_storage().data_ptr()
        if obj.nbytes and ptr in self._storages:
            raise NotHandedOver("two tensors share a storage")
        self._storages.add(ptr)
        self._tensors.append((t, obj.requires_grad))
        return len(self._tensors) - 1


def write(fh: BinaryIO, state: Any) -> int:
    """Write ``state`` (tensors and plain values, already checked by
    :func:`tasks.checkpoints.snapshot`) to the open binary file ``fh``;
    returns the bytes written.  Raises :class:`NotHandedOver` (before
    anything is written) for a tensor this format would not keep exactly."""
    tensors: list = []
    skeleton = io.BytesIO()
    _Pickler(skeleton, tensors).dump(state)
    table = [(str(t.dtype).removeprefix("torch."), tuple(t.shape), bool(grad), t.nbytes) for t, grad in tensors]
    header = pickle.dumps({"skeleton": skeleton.getvalue(), "tensors": table}, protocol=pickle.HIGHEST_PROTOCOL)
    fh.write(MAGIC + len(header).to_bytes(8, "little") + header)
    pos = len(MAGIC) + 8 + len(header)
    for t, _ in tensors:
        pad = -pos % _ALIGN
        fh.write(b"\0" * pad)
        pos += pad
        if t.nbytes:
            fh.write(t.reshape(-1).view(_byte_dtype()).numpy())
            pos += t.nbytes
    return pos


def read(path: Path) -> Any:
    """The state written by :func:`write` to ``path``, its tensors backed by
    one buffer holding the file.  Raises ``ValueError`` for a file that is
    not whole or not in this format, ``pickle.UnpicklingError`` for a
    skeleton naming anything outside the allow-list."""
    import torch

    data = bytearray(Path(path).read_bytes())
    if not data.startswith(MAGIC):
        raise ValueError(f"{path}: not a state handed over by tasks.handoff")
    start = len(MAGIC) + 8
    length = int.from_bytes(data[len(MAGIC):start], "little")
    header = _Unpickler(io.BytesIO(bytes(data[start:start + length])), []).load()
    pos = start + length
    view = memoryview(data)
    tensors = []
    for dtype_name, shape, grad, nbytes in header["tensors"]:
        pos += -pos % _ALIGN
        if pos + nbytes > len(data):
            raise ValueError(f"{path}: truncated ({len(data)} bytes)")
        dtype = getattr(torch, dtype_name)
        if nbytes:
            t = torch.frombuffer(view[pos:pos + nbytes], dtype=torch.uint8).view(dtype).reshape(shape)
        else:
            t = torch.empty(shape, dtype=dtype)
        tensors.append(t.requires_grad_(grad) if grad else t)
        pos += nbytes
    return _Unpickler(io.BytesIO(header["skeleton"]), tensors).load()


def _byte_dtype():
    import torch

    return torch.uint8


class _Unpickler(pickle.Unpickler):
    """Builds only containers, numbers, strings, bytes and torch's Size,
    dtypes and devices; tensors come from the raw section."""

    def __init__(self, fh: BinaryIO, tensors: list):
        super().__init__(fh)
        self._tensors = tensors

    def persistent_load(self, pid: Any) -> Any:
        return self._tensors[pid]

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (module, name) in {("builtins", "complex"), ("builtins", "set"), ("builtins", "frozenset")}:
            return {"complex": complex, "set": set, "frozenset": frozenset}[name]
        if module == "torch" and name in ("Size", "device"):
            return getattr(torch, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint state")
