"""The fleet under chaos, short form (the full run is `scripts/chaos.py`, recorded in
docs/reliability.md): 32 jobs through the REST API from several clients while workers are
`kill -9`ed (three of them, 8 to 15 s apart: on two cores each restart costs more than a
job, and kills until the end made the run as long as its luck), Redis is `kill -9`ed and
restarted at 10 s, and storage is frozen 20 s from 25 s: all before the jobs end (76 s on
the VM alone)."""

import pytest

from tests.faults import chaos
from tests.faults.fleet import StorageServer, make_fleet

pytestmark = pytest.mark.slow


def test_under_chaos_every_good_job_succeeds_once_with_the_calm_text(tmp_path, clips, tiny_en):
    plan = chaos.cases(clips, 32)
    calm = chaos.calm_texts(tiny_en, plan)
    storage = StorageServer()
    fleet = make_fleet(tmp_path, storage, fsync="always")
    try:
        report = chaos.run(
            fleet,
            storage,
            plan,
            calm,
            kill_every_s=(8, 15),
            redis_at_s=10,
            freeze_at_s=25,
            kills=3,
            timeout_s=600,
        )
        print(report)
        assert report.problems() == {}
        assert report.events  # the chaos happened: kills, the Redis restart, the freeze
    finally:
        fleet.close()
        storage.close()
        print(fleet.logs()[-20000:])
