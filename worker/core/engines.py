"""The models a worker's engine core serves (`worker.core.process`): each opened on first use,
warmed (the graphs an input without a prompt needs captured; its batcher captures the rest
while idle) and given a batcher that runs its stream, kept while the memory budget allows, the
least recently used dropped first.

A model loads (and, the first time, converts) outside the lock: inputs of the models already
loaded go on meanwhile, and those that want the loading one wait for it alone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future

from engine import Engine, EngineConfig, Stream, heap
from worker.contract.settings import Settings
from worker.core.batching import Batcher, DeviceFaultHandler
from worker.core.calls import UnknownModel, single_flight

log = logging.getLogger(__name__)


class Engines:
    """Each model's stream and the batcher that runs it, shared by the core's threads."""

    def __init__(
        self,
        settings: Settings,
        on_device_fault: DeviceFaultHandler | None = None,
        slots: int | None = None,
    ):
        """slots: each model's pool of decoding slots (default: as the settings size it)."""
        self.settings, self.on_device_fault, self.slots = settings, on_device_fault, slots
        self._loaded: OrderedDict[str, Batcher] = OrderedDict()
        self._loading: dict[str, Future[Batcher]] = {}
        self._lock = threading.Lock()  # the two maps above, never held while a model loads

    def config(self, name: str) -> EngineConfig:
        """How this worker runs model `name` (its settings as the engine's config)."""
        s = self.settings
        return EngineConfig(
            model=s.models[name],
            name=name,
            device=s.device,
            cache_dir=s.cache_dir,
            slots=self.slots,
            slot_memory_bytes=s.slot_memory_bytes,
            cross_kv=s.cross_kv,
            kernels=s.kernels,
            max_audio_s=s.max_audio_s,
            diarization=s.diarization,
        )

    def batcher(self, name: str) -> Batcher:
        """Model `name`'s batcher, the model opened and warmed if need be."""
        if name not in self.settings.models:
            available = ", ".join(self.settings.models)
            raise UnknownModel(f"unknown model {name!r}; available: {available}")
        with self._lock:
            if name in self._loaded:
                self._loaded.move_to_end(name)
                return self._loaded[name]
            loading, mine = single_flight(self._loading, name)
        if not mine:
            return loading.result()  # another thread loads it; its error is ours too
        try:
            batcher = self._open(name)
        except BaseException as e:
            with self._lock:
                del self._loading[name]
            loading.set_exception(e)
            raise
        loading.set_result(batcher)
        return batcher

    def _open(self, name: str) -> Batcher:
        start = time.monotonic()
        stream = Engine.open(self.config(name))
        loaded = time.monotonic()
        graphs = stream.warm()
        log.info(
            "model %s ready in %.1f s: loaded in %.1f s, warmed in %.1f s (%d graphs)",
            name, time.monotonic() - start, loaded - start, time.monotonic() - loaded, graphs,
        )  # fmt: skip
        s = self.settings
        batch = s.batch_size or stream.engine.encoder_batch
        batcher = Batcher(stream, batch, s.batch_max_wait_ms / 1000, self.on_device_fault)
        with self._lock:
            size = stream.engine.weight_bytes
            kept = sum(b.stream.engine.weight_bytes for b in self._loaded.values())
            while self._loaded and size + kept > s.model_memory_bytes:
                dropped, old = self._loaded.popitem(last=False)
                old.close()  # after the inputs it holds are done
                heap.thaw()  # its objects collectable again, cycles too
                kept -= old.stream.engine.weight_bytes
                log.info("dropped model %s to keep within %d bytes", dropped, s.model_memory_bytes)
            self._loaded[name] = batcher
            del self._loading[name]
        return batcher

    def get(self, name: str) -> Stream:
        """Model `name`'s stream, opened if need be (the batcher's thread steps it)."""
        return self.batcher(name).stream

    def healthy(self, stall_s: float = 60.0) -> bool:
        """Whether every model's batcher has turned its loop within `stall_s`."""
        now = time.monotonic()
        return all(now - b.last_tick < stall_s for b in list(self._loaded.values()))

    @property
    def loaded(self) -> list[str]:
        return list(self._loaded)
