"""Planning logic of the `first-fit-planner` policy, free of any binding.

A plan for a profiled training step (WIT 0.3.0): an arena and an offset
for each request. A step of ``n`` requests is a cycle of times ``0 .. n``;
request ``k`` is allocated at time ``k`` and holds its block until its
``freed_at`` (the index of the first request allocated after its free),
or, live at the step's end, until ``n`` and again from the next step's
start until ``wraps_to``. A request whose end of life is unknown
(``freed_at`` is None and ``wraps_to`` is None or later than ``k``) is not
planned (the engine's dynamic path serves it).

The heuristic is first fit in allocation order, i.e. a simulation of a
first-fit allocator over one arena:

1. requests that wrap into the next step (live at time 0 *and* at the end)
   get a region of their own at the bottom of the arena, one after the
   other;
2. the others, in allocation order: at time ``t`` the blocks of the
   requests that ended at ``t`` are freed (merged with free neighbours),
   then request ``t`` takes the lowest free range that holds it, or the
   top of the arena.

Every block is a multiple of 512 bytes, so every offset is too, and a
block is reused only after its request ended: the plan is valid. It is
simpler than the engine's greedy-by-size planner and its arena is
usually a little larger.
"""

import bisect

ALIGN = 512


def planned_bytes(nbytes):
    """The bytes a planned block of a request takes: rounded up to 512."""
    return -(-nbytes // ALIGN) * ALIGN


def plannable(freed_at, wraps_to, k):
    """Whether request ``k`` has a known lifetime in the step's cycle."""
    return freed_at is not None or (wraps_to is not None and wraps_to <= k)


class FreeList:
    """Free ranges of an arena, sorted by offset, merged when adjacent."""

    def __init__(self, base):
        self.offsets = []
        self.sizes = []
        self.top = base

    def take(self, size):
        """The lowest offset of a free range of ``size`` bytes (the top of
        the arena when none holds it)."""
        for i, s in enumerate(self.sizes):
            if s >= size:
                off = self.offsets[i]
                if s == size:
                    del self.offsets[i]
                    del self.sizes[i]
                else:
                    self.offsets[i] = off + size
                    self.sizes[i] = s - size
                return off
        off = self.top
        self.top += size
        return off

    def give(self, off, size):
        """Returns ``[off, off + size)`` to the free ranges."""
        i = bisect.bisect_left(self.offsets, off)
        # Merge with the range before and the one after.
        if i > 0 and self.offsets[i - 1] + self.sizes[i - 1] == off:
            i -= 1
            off = self.offsets[i]
            size += self.sizes[i]
            del self.offsets[i]
            del self.sizes[i]
        if i < len(self.offsets) and off + size == self.offsets[i]:
            size += self.sizes[i]
            del self.offsets[i]
            del self.sizes[i]
        if off + size == self.top:
            self.top = off
            return
        self.offsets.insert(i, off)
        self.sizes.insert(i, size)


def plan(requests):
    """The plan of ``requests``, a list of ``(bytes, freed_at, wraps_to)``
    tuples in allocation order (``freed_at``/``wraps_to`` None or an int):
    ``(arena_bytes, offsets)`` with one offset (or None) per request."""
    n = len(requests)
    offsets = [None] * n
    # 1. Wrapping requests: regions of their own at the bottom.
    base = 0
    for k, (nbytes, freed_at, wraps_to) in enumerate(requests):
        if freed_at is None and wraps_to is not None and 0 < wraps_to <= k:
            offsets[k] = base
            base += planned_bytes(nbytes)
    # 2. The others, by simulation in allocation order.
    free = FreeList(base)
    ending = [[] for _ in range(n + 1)]
    arena = base
    for t, (nbytes, freed_at, wraps_to) in enumerate(requests):
        for off, size in ending[t]:
            free.give(off, size)
        ending[t] = None
        if offsets[t] is not None or not plannable(freed_at, wraps_to, t):
            continue
        size = planned_bytes(nbytes)
        off = free.take(size)
        offsets[t] = off
        arena = max(arena, off + size)
        end = n if freed_at is None else min(max(freed_at, t + 1), n)
        if end < n:
            ending[end].append((off, size))
    return arena, offsets


def validate(requests, arena, offsets):
    """Checks a plan as the engine does (one entry per request, planned
    requests plannable, offsets aligned, blocks inside the arena, no two
    requests live at once sharing a byte); raises ValueError."""
    n = len(requests)
    if len(offsets) != n:
        raise ValueError(f"{len(offsets)} offsets for {n} requests")
    pieces = []
    for k, ((nbytes, freed_at, wraps_to), off) in enumerate(zip(requests, offsets)):
        if off is None:
            continue
        if not plannable(freed_at, wraps_to, k):
            raise ValueError(f"request {k} has no known end of life")
        if off % ALIGN:
            raise ValueError(f"request {k}: offset {off} is not a multiple of {ALIGN}")
        end = off + planned_bytes(nbytes)
        if end > arena:
            raise ValueError(f"request {k} leaves the arena")
        if freed_at is not None:
            pieces.append((k, max(freed_at, k + 1), off, end, k))
        else:
            pieces.append((k, n, off, end, k))
            if wraps_to and min(wraps_to, k) > 0:
                pieces.append((0, min(wraps_to, k), off, end, k))
    for i, (a0, a1, o0, e0, ka) in enumerate(pieces):
        for b0, b1, o1, e1, kb in pieces[i + 1:]:
            if ka != kb and a0 < b1 and b0 < a1 and o0 < e1 and o1 < e0:
                raise ValueError(f"requests {ka} and {kb} are live at once and share bytes")
