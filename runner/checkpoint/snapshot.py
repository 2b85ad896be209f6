"""Copies of the training state on the host, taken so the slow disk part of a checkpoint can run
while training goes on.

`snapshot` copies a model state and an optimizer state into CPU tensors that share nothing with
the live ones, validating them on the way (what torch.load(weights_only=True) and safetensors
cannot read back is refused here, before gigabytes are written). With `SnapshotBuffers` the
copies land in one host allocation made once and reused by every later snapshot of the same
state; with a CUDA stream (`take_snapshot`) the device→host copies are queued on that stream and
the call returns at once: training goes on, and whatever may overwrite the state (the next
optimizer update) must first wait for `Snapshot.ready`.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

_LEAF_TYPES = (type(None), bool, int, float, complex, str, bytes)
# Every tensor starts on a 64-byte boundary of the buffers' one allocation: aligned for any
# dtype and for the vectorised copies.
_ALIGN = 64
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable


def check_model_state(model_state: Mapping) -> None:
    """ValueError naming the first entry of `model_state` that safetensors cannot save: a
    non-string key, a non-tensor, a sparse or meta tensor, or two entries sharing storage."""
    import torch

    if not isinstance(model_state, Mapping):
        raise ValueError(
            f"model_state must be a dict of tensors, got "
            f"{type(model_state).__name__}; pass model.state_dict()"
        )
    by_storage: dict[tuple[str, int], str] = {}
    for key, t in model_state.items():
        if not isinstance(key, str):
            raise ValueError(
                f"model_state key {key!r} is not a string; safetensors names tensors by string keys"
            )
        if not isinstance(t, torch.Tensor):
            raise ValueError(
                f"model_state[{key!r}] is a {type(t).__name__}, not a tensor; move "
                "non-tensor state into meta or optim_state"
            )
        if t.is_sparse or t.device.type == "meta":
            raise ValueError(
                f"model_state[{key!r}] is a {t.layout}/{t.device} tensor; only dense "
                "tensors with data can be saved"
            )
        if t.numel() == 0:
            continue
        sid = (str(t.device), t.untyped_storage().data_ptr())
        if sid in by_storage:
            raise ValueError(
                f"model_state[{key!r}] shares storage with model_state[{by_storage[sid]!r}]; "
                "safetensors would store them as separate tensors and the alias would be lost on "
                "load. Tie weights by using one Parameter, or drop the alias from the state dict"
            )
        by_storage[sid] = key


def _copy_tree(obj: Any, where: str, copy: Callable[[torch.Tensor, str], Any]) -> Any:
    """The optimizer-side state with each tensor replaced by `copy(tensor, name)`, refusing
    anything torch.load(weights_only=True) cannot read back. `where` names the value in errors."""
    import torch

    if isinstance(obj, torch.Tensor):
        return copy(obj, f"optim{where}")
    if isinstance(obj, (*_LEAF_TYPES, torch.dtype, torch.device, torch.Size)):
        return obj
    if type(obj) in (dict, OrderedDict):
        out = type(obj)()
        for k, v in obj.items():
            if not isinstance(k, _LEAF_TYPES):
                raise ValueError(
                    f"optim_state{where} has a key of type {type(k).__name__}; use str or int keys"
                )
            out[k] = _copy_tree(v, f"{where}[{k!r}]", copy)
        return out
    if type(obj) in (list, tuple):
        return type(obj)(_copy_tree(v, f"{where}[{i}]", copy) for i, v in enumerate(obj))
    if type(obj) is set:
        return {_copy_tree(v, f"{where}{{}}", copy) for v in obj}
    raise ValueError(
        f"optim_state{where} is a {type(obj).__module__}.{type(obj).__qualname__}, which "
        "torch.load(weights_only=True) cannot read back; store it as tensors and plain "
        "containers (e.g. torch.from_numpy(array), a dict instead of an object)"
    )


def leaves_of(model_state: Mapping, optim_state: Mapping) -> list[torch.Tensor]:
    """Every tensor of both states, in the order a snapshot copies them (validating both)."""
    check_model_state(model_state)
    if not isinstance(optim_state, Mapping):
        raise ValueError(f"optim_state must be a dict, got {type(optim_state).__name__}")
    found = list(model_state.values())
    _copy_tree(dict(optim_state), "", lambda t, _: found.append(t))
    return found


def nbytes(leaves: list[torch.Tensor]) -> int:
    """The bytes of the tensors `leaves_of` found: what a checkpoint of them holds."""
    return sum(t.numel() * t.element_size() for t in leaves)


def _fresh_copy(t: torch.Tensor, where: str = "") -> torch.Tensor:
    import torch

    out = torch.empty(t.shape, dtype=t.dtype, device="cpu")  # contiguous
    out.copy_(t.detach())
    return out


class SnapshotBuffers:
    """One host copy of a training state, reused by every snapshot of the same state, so a
    checkpoint costs a copy and no allocation.

    Every tensor of the state lives in one host allocation of exactly the state's size (plus at
    most 64 bytes of alignment a tensor), each tensor a view of its own storage within it, so
    torch.save writes each one as it would a freshly allocated tensor. When the state is on CUDA
    that allocation is page-locked once (cudaHostRegister), so device→host copies run at the
    link's full speed without a bounce buffer; it then stays locked for the life of the buffers.
    (Pinning through torch's caching host allocator would round each allocation up to a power of
    two, up to twice the state's size.) A state whose layout changed (a tensor's shape or dtype,
    or their number) gets a new allocation.

    The tensors a snapshot returns ARE the buffers: the next snapshot overwrites them. Collect
    the write that reads them before snapshotting into the same buffers again."""

    def __init__(self) -> None:
        self._layout: tuple | None = None
        self._views: list[torch.Tensor] = []
        self._slab: np.ndarray | None = None
        self.pinned = False
        self.pin_error: str | None = None  # why a CUDA state's buffers could not be pinned
        self.allocated_bytes = 0  # bytes allocated by the latest prepare() (0 once warm)

    @property
    def nbytes(self) -> int:
        """Host memory held by the buffers."""
        return 0 if self._slab is None else int(self._slab.nbytes)

    def prepare(self, leaves: list[torch.Tensor]) -> None:
        """Hold a buffer for each of `leaves` (the state's tensors, in order): allocate (and
        pin, when any is on CUDA) unless the current buffers fit them already. Safe to run on
        a thread of its own, as long as nothing snapshots into these buffers meanwhile."""
        import torch

        layout = tuple((tuple(t.shape), t.dtype) for t in leaves)
        self.allocated_bytes = 0
        if layout == self._layout:
            return
        offsets, total = [], 0
        for shape, dtype in layout:
            offsets.append(total)
            n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            total += -(-n // _ALIGN) * _ALIGN
        self._release()
        slab = np.empty(max(total, _ALIGN), dtype=np.uint8)
        whole = memoryview(slab)
        views = []
        for (shape, dtype), start in zip(layout, offsets, strict=True):
            n = int(np.prod(shape, dtype=np.int64))
            if n == 0:
                views.append(torch.empty(shape, dtype=dtype))
                continue
            part = whole[start : start + n * dtype.itemsize]
            views.append(torch.frombuffer(part, dtype=dtype).view(shape))
        cuda = next((t.device for t in leaves if t.device.type == "cuda"), None)
        if cuda is not None:
            self._pin(slab, cuda)
        self._slab, self._views, self._layout = slab, views, layout
        self.allocated_bytes = int(slab.nbytes)

    def _pin(self, slab: np.ndarray, device: torch.device) -> None:
        import torch

        ptr = slab.ctypes.data
        # Under the state's own device (a thread starts on device 0, whose context a rank of
        # another GPU must not create), and portable: pinned for every context of the process.
        with torch.cuda.device(device):
            err = torch.cuda.cudart().cudaHostRegister(ptr, slab.nbytes, _HOST_REGISTER_PORTABLE)
        if int(err) != 0:
            # The copies still work from pageable memory, through the driver's staging buffer.
            self.pin_error = f"cudaHostRegister failed with CUDA error {int(err)}"
            return
        self.pinned = True
        weakref.finalize(slab, _unpin, ptr)

    def _release(self) -> None:
        self._layout, self._views, self._slab, self.pinned = None, [], None, False

    def fill(
        self,
        model_state: Mapping[str, torch.Tensor],
        optim_state: Mapping,
        stream: Any = None,
    ) -> Snapshot:
        """Copy both states into the buffers (preparing them first if their layout changed).
        With a CUDA `stream`, the copies are queued on it after everything queued so far on the
        current stream and the result's `ready` event marks their end; without one, they are
        complete when this returns."""
        import torch

        leaves = leaves_of(model_state, optim_state)
        self.prepare(leaves)
        device = next((t.device for t in leaves if t.device.type == "cuda"), None)
        on_cuda = device is not None
        views: Iterator[torch.Tensor] = iter(self._views)

        def copy(t: torch.Tensor, _where: str = "") -> torch.Tensor:
            buf = next(views)
            if t.numel():
                # Into pinned memory a device→host copy is queued and the call returns at once.
                buf.copy_(t.detach(), non_blocking=self.pinned and t.device.type == "cuda")
            return buf

        if not on_cuda or stream is None:
            cpu_model = {k: copy(t) for k, t in model_state.items()}
            cpu_optim = _copy_tree(dict(optim_state), "", copy)
            if on_cuda:
                torch.cuda.synchronize(device)
            return Snapshot(cpu_model, cpu_optim, None)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            cpu_model = {k: copy(t) for k, t in model_state.items()}
            cpu_optim = _copy_tree(dict(optim_state), "", copy)
            ready = torch.cuda.Event()
            ready.record(stream)
        return Snapshot(cpu_model, cpu_optim, ready)


def _unpin(ptr: int) -> None:
    import torch

    torch.cuda.cudart().cudaHostUnregister(ptr)


@dataclass
class Snapshot:
    """A state's host copy: `model` (name → tensor) and `optim` (the optimizer-side tree), both
    complete once `ready` (a CUDA event, or None when the copy was synchronous) has passed."""

    model: dict[str, torch.Tensor]
    optim: dict
    ready: Any = None

    def wait(self) -> None:
        """Block until the copies are complete."""
        if self.ready is not None:
            self.ready.synchronize()


def snapshot(
    model_state: Mapping[str, torch.Tensor],
    optim_state: Mapping,
    *,
    buffers: SnapshotBuffers | None = None,
) -> tuple[dict[str, torch.Tensor], dict]:
    """Both states copied to contiguous CPU tensors that share nothing with the live state,
    complete when this returns. Without `buffers` every tensor is freshly allocated; with them
    the copies land in (and the result aliases) the reused buffers. Either way the written
    checkpoint is byte-for-byte the same."""
    if buffers is None:
        leaves_of(model_state, optim_state)  # validate before copying anything
        return (
            {k: _fresh_copy(t) for k, t in model_state.items()},
            _copy_tree(dict(optim_state), "", _fresh_copy),
        )
    snap = buffers.fill(model_state, optim_state)
    return snap.model, snap.optim
