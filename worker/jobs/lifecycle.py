"""What a worker process runs besides its jobs, started and stopped by Celery's own worker
signals, so that a worker started as operators do (`celery -A worker.app worker`) is as safe
as `whisperfleet worker`:

- log lines that name their job (`WHISPERFLEET_LOG_FORMAT`);
- the default model loaded (and converted, the first time) before any message is taken;
- the heartbeat that renews the lease of every job the process runs, and the looks at their
  records (`worker.jobs.looks`: cancels seen, progress written);
- its presence on the queues it consumes (`worker.contract.presence`), marked once Celery
  consumes them and renewed while the engine turns: the API's `/readyz` is ready only while
  every queue has a worker;
- the reconciler that takes over the jobs of workers that died (and ends those whose result is
  stored or whose age ran out), and deletes job inputs no record claims (`worker.jobs.orphans`);
- Prometheus metrics on `WHISPERFLEET_METRICS_PORT`, and `/ready` there (200 once it takes
  jobs);
- the engine core (`worker.core.process`), the process that holds the models, stopped with the
  worker; a fault of the GPU ends the core and the worker with it (exit 70): its CUDA context
  cannot be trusted, a supervisor starts a new worker, and the jobs in flight are taken over
  by lease.
"""

from __future__ import annotations

import logging
import threading
import time

import redis
from celery.signals import (
    setup_logging,
    worker_init,
    worker_ready,
    worker_shutdown,
    worker_shutting_down,
)

from worker import logs, metrics
from worker.contract.dispatch import dispatch
from worker.contract.jobs import JobRecord
from worker.contract.presence import Presence
from worker.contract.settings import get_settings
from worker.core.process import exit_with_core
from worker.jobs.execute import stored_result
from worker.jobs.leases import Reconciler
from worker.jobs.orphans import OrphanSweeper
from worker.jobs.tasks import WORKER_ID, app, transcribe

log = logging.getLogger(__name__)

_stop = threading.Event()
_queues: list[str] = []  # those this worker consumes, once it does
_said_at_start: list[str] = []  # its model's load, its metrics: for its one line at start
_leaving = threading.Event()  # set as it begins to shut down: its jobs in flight still run
_presence_lock = threading.Lock()  # no mark renewed after it is withdrawn


@setup_logging.connect
def _configure_logging(**_: object) -> None:
    logs.configure(get_settings().log_format)


@worker_init.connect
def _start(sender, **_: object) -> None:
    """Before the worker consumes: metrics (`/ready` says 503 meanwhile), the default model
    loaded, the threads started; then it is ready."""
    settings = get_settings()
    if isinstance(sender.concurrency, int):  # as --concurrency or the settings gave it
        transcribe.threads = sender.concurrency
    logs.configure(settings.log_format)  # Celery sets its logging up only after this signal
    served = metrics.serve(
        settings.metrics_host, settings.metrics_port, transcribe.store, transcribe.leases.held
    )
    transcribe.engines.on_exit = exit_with_core
    started = time.monotonic()
    transcribe.engines.load(settings.default_model)  # and warmed, in the engine core
    took = time.monotonic() - started
    _said_at_start[:] = [
        f"; {settings.default_model} loaded and warm in {took:.1f} s"
        + (f"; metrics on {served} (/ready there)" if served else "")
    ]

    def stored(record: JobRecord) -> float | None:
        result = stored_result(transcribe.storage, record)
        return None if result is None else result.duration

    reconciler = Reconciler(
        transcribe.store,
        transcribe.leases,
        lambda record: dispatch(app, transcribe.store, record),
        stored,
        settings.stale_after_s,
        settings.max_job_age_s,
        OrphanSweeper(
            transcribe.storage,
            transcribe.store,
            settings.orphan_sweep_s,
            settings.record_lifetime_s,
        ),
    )
    threading.Thread(
        target=reconciler.loop, args=(settings.reconcile_every_s, _stop), daemon=True
    ).start()
    threading.Thread(
        target=transcribe.leases.heartbeat, args=(transcribe.engines.healthy, _stop), daemon=True
    ).start()
    threading.Thread(target=transcribe.looks.loop, args=(_stop,), daemon=True).start()
    metrics.READY.set()


@worker_ready.connect
def _present(sender, **_: object) -> None:
    """Celery consumes the queues now: mark this worker on them, and keep the mark while its
    engine turns (a stalled engine lets it lapse, as it lets the leases lapse)."""
    _queues[:] = [queue.name for queue in sender.task_consumer.queues]
    logs.ready(sender, "jobs", *_said_at_start)
    presence, ttl_s = Presence(transcribe.store.redis), get_settings().lease_s

    def renew() -> None:
        while True:
            with _presence_lock:
                if _leaving.is_set():
                    return
                if transcribe.engines.healthy():
                    try:
                        presence.mark(WORKER_ID, _queues, ttl_s)
                    except redis.RedisError as e:
                        log.warning("presence: Redis unavailable (%s); trying again", e)
            if _leaving.wait(ttl_s / 3):
                return

    threading.Thread(target=renew, daemon=True).start()


def _withdraw() -> None:
    with _presence_lock:
        _leaving.set()
        try:
            Presence(transcribe.store.redis).withdraw(WORKER_ID, _queues)
        except redis.RedisError as e:
            log.warning("presence: not withdrawn (%s); it lapses by itself", e)


@worker_shutting_down.connect
def _draining(**_: object) -> None:
    """Draining from now (its jobs in flight finish): no longer counted as taking jobs. Sent
    from a signal handler, which must not wait on Redis: withdrawn from a thread."""
    threading.Thread(target=_withdraw, daemon=True).start()


@worker_shutdown.connect
def _stop_threads(**_: object) -> None:
    metrics.READY.clear()
    _withdraw()
    _stop.set()
    transcribe.engines.close()
