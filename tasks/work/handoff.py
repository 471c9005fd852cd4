"""Hand a checkpoint's state from the work's thread to the supervisor for
the price of a copy.

``torch.save`` spends most of its time on small states in Python, once per
pickled object (~1.5 ms for the example's 17 tensors inside its training
loop; 10% of its 15 ms epoch), all of it on the training thread and under
the GIL, so a thread of the work's process cannot take it over.
:func:`encode` and :func:`write_file` therefore store the state as raw
tensor bytes plus a pickled skeleton of everything else, checking on the
way that it holds only tensors and plain values (one file, one ``writev``);
the supervisor's process turns it into a regular ``torch.save`` file with
:func:`read` when it commits the checkpoint
(:func:`e31.tasks.work.local_checkpoints.commit_pending`).  The committed format is
torch's own; this one lives only in an uncommitted ``step-<N>.handoff``.

Only states whose every tensor is a plain, dense, contiguous tensor owning
its whole storage, none sharing storage with another, are handed over this
way (what ``state_dict()`` gives); for anything else :func:`encode` raises
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
import os
import pickle
from pathlib import Path
from typing import Any, BinaryIO

MAGIC = b"E31STATE1\n"
_ALIGN = 64
_IOV_MAX = 512  # buffers per writev call (Linux allows 1024)


class NotHandedOver(Exception):
    """The state holds a tensor this format does not keep exactly (a view,
    a shared storage, a subclass such as ``nn.Parameter``, a sparse or
    quantized tensor): save it with ``torch.save`` instead."""


class NotPlain(Exception):
    """The state holds something other than tensors and plain values
    (:func:`e31.tasks.work.local_checkpoints.snapshot` names it)."""


def _allowed() -> tuple[set, set]:
    import torch

    values = {bool, int, float, complex, str, bytes, type(None), dict, collections.OrderedDict, list, tuple, set,
              torch.Size, torch.dtype, torch.device}
    classes = {collections.OrderedDict, torch.Size, torch.device, complex}  # what their pickled forms name
    return values, classes


class _Pickler(pickle.Pickler):
    """Pickles the skeleton: every object must be a plain value or container
    (the checks of :func:`e31.tasks.work.local_checkpoints.snapshot`, made while pickling);
    tensors become persistent ids and are kept aside."""

    def __init__(self, fh: BinaryIO, tensors: list):
        super().__init__(fh, protocol=pickle.HIGHEST_PROTOCOL)
        self._tensors = tensors
        self._storages: set[int] = set()
        self._values, self._classes = _ALLOWED or _allowed()

    def persistent_id(self, obj: Any) -> Any:
        kind = type(obj)
        if kind in self._values:
            return None
        if kind is _TENSOR:
            return self._tensor(obj)
        if obj in self._classes if kind is type else False:
            return None
        if isinstance(obj, _TENSOR):
            raise NotHandedOver(f"a {kind.__name__}")
        raise NotPlain(kind.__name__)

    def _tensor(self, obj: Any) -> int:
        import torch

        if obj.layout != torch.strided or obj.is_quantized:
            raise NotHandedOver(f"a tensor with layout {obj.layout}")
        storage = obj.untyped_storage()
        if not (obj.is_contiguous() and obj.storage_offset() == 0 and storage.nbytes() == obj.nbytes):
            raise NotHandedOver("a view of a larger storage")
        ptr = storage.data_ptr()
        if obj.nbytes and ptr in self._storages:
            raise NotHandedOver("two tensors share a storage")
        self._storages.add(ptr)
        t = obj if obj.device.type == "cpu" else obj.to("cpu")  # written as a CPU tensor, as map_location="cpu" loads it
        self._tensors.append((t, obj.requires_grad))
        return len(self._tensors) - 1


_ALLOWED: tuple[set, set] | None = None
_TENSOR: Any = None


class Encoded:
    """A state ready to write: ``buffers`` (bytes-like, in file order) and
    ``size`` in bytes.  Holds the tensors the buffers point into."""

    def __init__(self, buffers: list, size: int, keep: list):
        self.buffers, self.size, self._keep = buffers, size, keep


def encode(state: Any) -> Encoded:
    """Check ``state`` and lay it out in this format, without copying tensor
    bytes.  Raises :class:`NotPlain` for anything but tensors and plain
    values, :class:`NotHandedOver` for a tensor this format would not keep
    exactly."""
    import ctypes

    global _ALLOWED, _TENSOR
    if _ALLOWED is None:
        import torch

        _ALLOWED, _TENSOR = _allowed(), torch.Tensor
    tensors: list = []
    skeleton = io.BytesIO()
    _Pickler(skeleton, tensors).dump(state)
    table = [(str(t.dtype)[6:], tuple(t.shape), bool(grad), t.nbytes) for t, grad in tensors]
    header = pickle.dumps({"skeleton": skeleton.getvalue(), "tensors": table}, protocol=pickle.HIGHEST_PROTOCOL)
    buffers: list = [MAGIC + len(header).to_bytes(8, "little") + header]
    pos = len(buffers[0])
    for t, _ in tensors:
        pad = -pos % _ALIGN
        if pad:
            buffers.append(bytes(pad))
            pos += pad
        if t.nbytes:
            buffers.append((ctypes.c_char * t.nbytes).from_address(t.data_ptr()))
            pos += t.nbytes
    return Encoded(buffers, pos, [t for t, _ in tensors])


def write_file(path: Path, encoded: Encoded) -> None:
    """Write ``encoded`` to ``path`` whole: under a temporary name
    (``.<name>.<random>.part``) renamed into place once every byte is
    written, so ``path`` existing means the state is whole.  No fsync (the
    supervisor makes the committed checkpoint durable)."""
    tmp = path.with_name(f".{path.name}.{os.urandom(4).hex()}.part")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        buffers = [memoryview(b).cast("B") for b in encoded.buffers]
        while buffers:
            done = os.writev(fd, buffers[:_IOV_MAX])
            while buffers and done >= len(buffers[0]):
                done -= len(buffers[0])
                buffers.pop(0)
            if buffers and done:
                buffers[0] = buffers[0][done:]
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)


def read(path: Path) -> Any:
    """The state written by :func:`write_file` to ``path``, its tensors backed by
    one buffer holding the file.  Raises ``ValueError`` for a file that is
    not whole or not in this format, ``pickle.UnpicklingError`` for a
    skeleton naming anything outside the allow-list."""
    import torch

    data = bytearray(Path(path).read_bytes())
    if not data.startswith(MAGIC):
        raise ValueError(f"{path}: not a state handed over by e31.tasks.work.handoff")
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
