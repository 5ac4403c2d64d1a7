"""Point-in-time CPU copies of a training state, for publishing in the background.

An asynchronous publish must copy the state before it returns: the trainer
goes on to modify its tensors at once, and the writer needs the values of the
moment of the call. The copy goes into an *arena*, one flat byte buffer that
every tensor of the snapshot is a view of, and arenas are reused from one
publish to the next. Why reuse: a fresh 1 GiB buffer costs ~250,000 page
faults (or a pinned ``cudaHostAlloc``), several times the cost of the copy
itself, so a trainer that publishes every N steps pays the allocation once.
Tensors on CUDA are copied into pinned memory with non-blocking copies that
all complete before :meth:`Snapshotter.take` returns.

The store knows nothing of this; the snapshot is just another ``Payload``
whose tensors happen to live in one buffer.
"""

from __future__ import annotations

import bisect
import copy
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from registry.pools import Pool

if TYPE_CHECKING:
    import torch

ALIGN = 64  # every view starts on a cache line, so any dtype may be viewed there
PARALLEL_COPY_FROM = 8 << 20  # below this, handing runs to threads costs more than it saves
SMALL_TENSOR = 1 << 20  # a state whose tensors average more than this copies in parallel inside torch
_COPY_THREADS = min(8, os.cpu_count() or 1)
_COPY_POOL = Pool(_COPY_THREADS, "registry-snapshot")


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _tensors(obj: Any, out: dict[int, torch.Tensor], tensor: type[torch.Tensor]) -> None:
    """Every distinct tensor object in a nest of dicts, lists and tuples (``tensor`` is ``torch.Tensor``)."""
    if isinstance(obj, tensor):
        out.setdefault(id(obj), obj)
    elif isinstance(obj, Mapping):
        for value in obj.values():
            _tensors(value, out, tensor)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _tensors(value, out, tensor)


def _rebuild(obj: Any, copies: dict[int, torch.Tensor], memo: dict[int, Any], tensor: type[torch.Tensor]) -> Any:
    """``obj`` with every tensor replaced by its copy and every container rebuilt."""
    if isinstance(obj, tensor):
        return copies[id(obj)]
    if isinstance(obj, Mapping):
        items = [(k, _rebuild(v, copies, memo, tensor)) for k, v in obj.items()]
        rebuild: Any = type(obj)  # a Mapping subclass whose constructor takes pairs, as dict's does
        try:
            return rebuild(items)
        except TypeError:
            return dict(items)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_rebuild(v, copies, memo, tensor) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_rebuild(v, copies, memo, tensor) for v in obj)
    return copy.deepcopy(obj, memo)


@dataclass(kw_only=True, eq=False)  # arenas are compared by identity, never by contents
class _Arena:
    buffer: torch.Tensor  # uint8, flat
    pinned: bool
    # the views of the last snapshot and the (dtype, shape) list they were cut
    # for: a trainer snapshots the same layout every time, so they are reused
    layout: tuple[tuple[torch.dtype, torch.Size], ...] | None = None
    views: list[torch.Tensor] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # where each view starts in the buffer

    def views_for(self, layout: tuple[tuple[torch.dtype, torch.Size], ...]) -> list[torch.Tensor]:
        if layout != self.layout:
            views, offsets, offset = [], [], 0
            for dtype, shape in layout:
                nbytes = shape.numel() * dtype.itemsize
                views.append(self.buffer[offset:offset + nbytes].view(dtype).view(shape))
                offsets.append(offset)
                offset += _align(nbytes)
            self.layout, self.views, self.offsets = layout, views, offsets
        return self.views

    def copy_into(self, sources: list[torch.Tensor], total: int, *, non_blocking: bool) -> None:
        """Copy ``sources`` into the views cut for their layout.

        Many small CPU tensors are split into runs of about equal bytes copied
        on several threads (``_foreach_copy_`` releases the GIL); a large
        tensor's copy is already parallel inside torch, and a copy from CUDA
        is an asynchronous DMA either way.
        """
        import torch
        workers = min(_COPY_THREADS, len(sources))
        if non_blocking or workers < 2 or total < PARALLEL_COPY_FROM or total > len(sources) * SMALL_TENSOR:
            torch._foreach_copy_(self.views, sources, non_blocking=non_blocking)
            return
        cuts = [0, *(bisect.bisect_left(self.offsets, total * k // workers) for k in range(1, workers)),
                len(sources)]
        runs = [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]
        for done in [_COPY_POOL.submit(_copy_run, self.views[a:b], sources[a:b]) for a, b in runs]:
            done.result()

    def owned(self, index: int) -> torch.Tensor:
        """The bytes of view ``index`` as a tensor whose storage is exactly those bytes (no copy).

        For the tensors of ``extra``: ``torch.save`` writes a tensor's whole
        storage, so a view of the arena would put the whole snapshot into
        every ``.pt`` file (and ``torch.save`` refuses two dtypes over one
        storage). Built as :func:`registry.format.safetensors.tensors_in` builds
        a loaded file's tensors.
        """
        import torch
        view = self.views[index]
        nbytes = view.numel() * view.element_size()
        if nbytes == 0:
            return torch.empty(view.shape, dtype=view.dtype)
        start = self.offsets[index]
        tensor = torch.frombuffer(self.buffer.numpy()[start:start + nbytes], dtype=view.dtype)
        if view.dim() != 1:
            tensor.resize_(view.shape)  # in place: the same bytes, no view keeping a base alive
        return tensor

    @property
    def size(self) -> int:
        return self.buffer.numel()


def _copy_run(views: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    import torch
    with torch.no_grad():  # grad mode is per thread: without this the copies would join the autograd graph
        torch._foreach_copy_(views, sources)


@dataclass(kw_only=True)
class Snapshot:
    """The copied objects and a way to hand the arena back once they are written."""

    state_dict: dict[str, torch.Tensor]
    extra: dict[str, Any]
    nbytes: int
    _release: Callable[[], None] = field(repr=False)
    _released: bool = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._release()


class Snapshotter:
    """Copies states into reusable arenas; keeps at most ``keep`` idle arenas of each kind.

    Thread-safe: snapshots are taken on the trainer's thread and released on
    the writer's.
    """

    def __init__(self, *, keep: int = 1) -> None:
        self._keep = keep
        self._idle: list[_Arena] = []
        self._lock = threading.Lock()

    def _get(self, size: int, pinned: bool) -> _Arena:
        import torch
        with self._lock:
            fits = [a for a in self._idle if a.pinned == pinned and a.size >= size]
            if fits:
                arena = min(fits, key=lambda a: a.size)
                self._idle.remove(arena)
                return arena
        return _Arena(buffer=torch.empty(max(size, 1), dtype=torch.uint8, pin_memory=pinned), pinned=pinned)

    def _put(self, arena: _Arena) -> None:
        with self._lock:
            self._idle.append(arena)
            same = sorted((a for a in self._idle if a.pinned == arena.pinned), key=lambda a: -a.size)
            for extra in same[self._keep:]:
                self._idle.remove(extra)

    def clear(self) -> None:
        with self._lock:
            self._idle.clear()

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(a.size for a in self._idle)

    def take(self, state_dict: Mapping[str, torch.Tensor], extra: Mapping[str, Any]) -> Snapshot:
        """Copy every tensor of ``state_dict`` and ``extra`` now; the copies are CPU tensors.

        Non-tensor leaves of ``extra`` are deep-copied. A tensor object that
        appears twice is copied once and appears twice in the copy. The copy is
        one batched ``_foreach_copy_`` into views cut once per layout: with
        thousands of small tensors, per-tensor Python calls (cutting a view,
        launching a copy) cost several times the copying itself.
        """
        import torch
        found: dict[int, torch.Tensor] = {id(t): t for t in state_dict.values()}
        _tensors(extra, found, torch.Tensor)
        sources = list(found.values())
        layout = tuple((t.dtype, t.shape) for t in sources)
        total = sum(_align(shape.numel() * dtype.itemsize) for dtype, shape in layout)
        pinned = torch.cuda.is_available() and any(t.is_cuda for t in sources)
        arena = self._get(total, pinned)
        try:
            views = arena.views_for(layout)
            if sources:  # _foreach_copy_ refuses empty lists
                with torch.no_grad():
                    arena.copy_into(sources, total, non_blocking=pinned)
            if pinned:
                torch.cuda.synchronize()  # the caller may overwrite its tensors once we return
            copies = {key: view for key, view in zip(found, views)}
            memo: dict[int, Any] = {}
            snap_state = {name: copies[id(t)] for name, t in state_dict.items()}
            in_extra: dict[int, torch.Tensor] = {}
            _tensors(extra, in_extra, torch.Tensor)
            index = {key: i for i, key in enumerate(found)}
            owned = {key: arena.owned(index[key]) for key in in_extra}  # extras are pickled: own storages
            snap_extra = {key: _rebuild(value, owned, memo, torch.Tensor) for key, value in extra.items()}
        except BaseException:
            self._put(arena)
            raise
        return Snapshot(state_dict=snap_state, extra=snap_extra, nbytes=total,
                        _release=lambda: self._put(arena))
