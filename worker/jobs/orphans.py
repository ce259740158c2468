"""What jobs leave behind without a record, deleted: their uploaded inputs and their entries in
their tenants' lists.

The API stores a submission's input, then writes its record; when the record cannot be written
it deletes the input itself. When even that fails (storage away at that moment, or a put that
storage finished after the API had given up on it), the object stays at
`jobs/<tenant>/<id>/input` without a record `<id>`. So does the input of every job whose record
expired after its retention. The reconciling worker runs this sweeper every `ORPHAN_SWEEP_S`:
an input found without a record at two sweeps in a row is deleted. Two looks, not the object's
age: a submission's record follows its input within milliseconds, but S3 dates an object
uploaded in parts from the start of a long upload. And the tenants' lists forget the jobs
made longer ago than a record can live.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime, timedelta

from botocore.exceptions import BotoCoreError, ClientError

from worker.contract.jobs import JobStore
from worker.storage import Storage

log = logging.getLogger(__name__)


class OrphanSweeper:
    def __init__(self, storage: Storage, store: JobStore, every_s: float, record_lifetime_s: float):
        self.storage, self.store, self.every_s = storage, store, every_s
        self.record_lifetime_s = record_lifetime_s  # Settings.record_lifetime_s
        self.unclaimed: set[str] = set()  # inputs without a record at the last sweep
        self.next_at = 0.0

    def __call__(self) -> None:
        """Sweep when `every_s` has passed since the last sweep (the reconciler calls this at
        each of its turns). Storage away: tried again at the next sweep."""
        if time.monotonic() < self.next_at:
            return
        self.next_at = time.monotonic() + self.every_s
        made_before = datetime.now(UTC) - timedelta(seconds=self.record_lifetime_s)
        if forgotten := self.store.forget_listed(made_before):
            log.info("orphan sweep: %d list entries of jobs made before %s", forgotten, made_before)
        try:
            if deleted := self.sweep():
                log.info("orphan sweep: deleted %d inputs no job record claims", deleted)
        except (BotoCoreError, ClientError) as e:
            log.warning("orphan sweep: storage unavailable (%s); trying again later", e)

    def sweep(self) -> int:
        """One sweep over every job input; the number deleted."""
        unclaimed, deleted = set(), 0
        for keys in self.storage.pages("jobs/"):
            inputs = [k for k in keys if k.endswith("/input") and k.count("/") == 3]
            claimed = self.store.exist([k.split("/")[2] for k in inputs])
            for key in (k for k, c in zip(inputs, claimed, strict=True) if not c):
                if key in self.unclaimed:
                    self.storage.delete(key)
                    deleted += 1
                else:
                    unclaimed.add(key)
        self.unclaimed = unclaimed
        return deleted
