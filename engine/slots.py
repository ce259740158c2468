"""The pool of decoding slots: each slot's caches and decode state, and the sequence in it.

Live sequences are packed at the front of the pool (slots 0 .. n_live - 1), so a decode step is
the model run on the range `[:bucket]` of every buffer and every cache read is a view. When a
sequence finishes, its slot is released; `compact` then moves the last live sequences into the
holes, all moves in one gather per buffer and layer. The buckets round a batch up to a size a
CUDA graph was captured for.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.decoding import SlotState, WindowTask
from engine.loader import LoadedModel
from engine.model import KVCache, ModelDimensions

DECODE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)
ENCODER_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
KEY_STEP = 64  # self-attention reads positions in buckets of this many
MAX_SLOTS = 512


def slot_bytes(dims: ModelDimensions, dtype: torch.dtype, cross_dtype: torch.dtype) -> int:
    """Cache bytes one slot takes at most: self- (all n_text_ctx positions) and cross-attention
    K/V of every layer."""
    per_position = 2 * dims.n_text_layer * dims.n_text_state
    self_bytes = dims.n_text_ctx * dtype.itemsize
    return per_position * (self_bytes + dims.n_audio_ctx * cross_dtype.itemsize)


def slots_for(
    loaded: LoadedModel, memory_bytes: int | None, cross_dtype: torch.dtype | None = None
) -> int:
    """Slots for the pool: `slots_within` the budget, each slot_bytes."""
    per_slot = slot_bytes(loaded.dims, loaded.dtype, cross_dtype or loaded.dtype)
    return slots_within(memory_bytes, loaded.device, per_slot)


def slots_within(
    memory_bytes: int | None, device: torch.device, per_slot: int, most: int = MAX_SLOTS
) -> int:
    """As many slots of `per_slot` bytes as `memory_bytes` of cache holds, at most `most`.
    Default budget: on CUDA half the free device memory, on the CPU 16 slots."""
    if memory_bytes is None:
        if device.type != "cuda":
            return min(16, most)
        memory_bytes = torch.cuda.mem_get_info(device)[0] // 2
    return max(1, min(most, memory_bytes // per_slot))


def bucket(n: int, buckets: tuple[int, ...], most: int) -> int:
    """The smallest of `buckets` that holds n, or `most` past the last one; never above it."""
    i = bisect.bisect_left(buckets, n)
    return min(buckets[i] if i < len(buckets) else most, most)


def key_bucket(furthest: int, text_ctx: int) -> int:
    """Self-attention positions a step reads to reach position `furthest - 1`: a multiple of
    KEY_STEP, so few graphs cover every length."""
    return min(-(-furthest // KEY_STEP) * KEY_STEP, text_ctx)


@dataclass
class Sequence:
    """One window being decoded in a slot."""

    owner: object  # what the caller gets back with the result
    task: WindowTask
    attempt: int = 0  # index into the caller's temperatures


class SlotPool:
    """`n_slots` slots: the attention caches, the decode state, and which sequence holds each."""

    def __init__(
        self,
        loaded: LoadedModel,
        n_slots: int,
        text_ctx: int,
        sample_len: int,
        cross_dtype: torch.dtype | None,
    ):
        d, device = loaded.dims, loaded.device
        self.n_slots, self.text_ctx = n_slots, text_ctx
        # and one spare slot past them, where a graph's padding rows write (`engine.runner`)
        self.cache = KVCache.allocate(d, n_slots + 1, device, loaded.dtype, text_ctx, cross_dtype)
        self.state = SlotState.allocate(n_slots + 1, sample_len, loaded.tokenizer.eot, device)
        self.live: list[Sequence | None] = []
        self.next_position: list[int] = []  # host copy of each live row's fed position

    @property
    def n_live(self) -> int:
        return len(self.live)

    @property
    def free(self) -> int:
        return self.n_slots - len(self.live)

    def occupy(self, sequences: list[Sequence], positions: list[int]) -> None:
        """Make `sequences` live in the next free slots, each fed from its position."""
        if len(sequences) > self.free:
            raise ValueError(f"{len(sequences)} sequences, but {self.free} free slots")
        self.live.extend(sequences)
        self.next_position.extend(positions)

    def release(self, slot: int) -> None:
        self.live[slot] = None

    def release_where(self, owned: Callable[[Sequence], bool]) -> None:
        for slot, sequence in enumerate(self.live):
            if sequence is not None and owned(sequence):
                self.release(slot)

    def clear(self) -> None:
        self.live.clear()
        self.next_position.clear()

    def compact(self) -> None:
        """Fill the holes released sequences left with the last live ones, all moves in one
        gather per buffer and layer."""

        def drop_tail() -> None:
            while self.live and self.live[-1] is None:
                self.live.pop()
                self.next_position.pop()

        drop_tail()
        sources, holes = [], []
        for hole in [i for i, s in enumerate(self.live) if s is None]:
            if hole >= len(self.live):
                break
            sources.append(len(self.live) - 1)
            holes.append(hole)
            self.live[hole] = self.live.pop()
            self.next_position[hole] = self.next_position.pop()
            drop_tail()
        if holes:
            device = self.state.token.device
            src = torch.tensor(sources, device=device)
            dst = torch.tensor(holes, device=device)
            # a layer at a time: the gathered copy of every layer at once would be a
            # transient of 246 MB per moved slot for large-v3
            c = self.cache
            for t in (c.self_k, c.self_v, c.cross_k, c.cross_v):
                for layer in t:
                    layer[dst] = layer[src]
            for t in self.state.tensors():
                t[dst] = t[src]
