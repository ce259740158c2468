"""The fleet under chaos, short form (the full run is `scripts/chaos.py`, recorded in
docs/reliability.md): 20 jobs through the REST API from several clients to two workers while
workers are `kill -9`ed (two of them, 5 to 9 s apart: on two cores each restart costs more
than a job, and kills until the end made the run as long as its luck), Redis is `kill -9`ed
and restarted at 6 s, and storage is frozen 10 s from 12 s: all before the jobs end."""

import pytest

from tests.faults import chaos
from tests.faults.fleet import StorageServer, make_fleet

pytestmark = pytest.mark.slow


def test_under_chaos_every_good_job_succeeds_once_with_the_calm_text(tmp_path, clips, tiny_en):
    plan = chaos.cases(clips, 20)
    calm = chaos.calm_texts(tiny_en, plan)
    storage = StorageServer()
    fleet = make_fleet(tmp_path, storage, fsync="always")
    try:
        report = chaos.run(
            fleet,
            storage,
            plan,
            calm,
            workers=2,
            kill_every_s=(5, 9),
            redis_at_s=6,
            freeze_at_s=12,
            freeze_s=10,
            kills=2,
            timeout_s=600,
        )
        print(report)
        assert report.problems() == {}
        # the chaos happened before the jobs ended: two kills, the Redis restart, the freeze
        assert len(report.events) == 4, report.events
    finally:
        fleet.close()
        storage.close()
        print(fleet.logs()[-20000:])
