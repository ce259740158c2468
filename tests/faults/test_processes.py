"""The reliability contract inside a worker: its job processes and engine core killed, a poison
job, one worker per GPU restarted, a worker for interactive jobs alone
(`tests/faults/fleet.py`: its own Redis, moto's S3 server, real worker processes)."""

from __future__ import annotations

import time

import httpx
import psutil
import pytest

from tests.conftest import free_port, long_speech
from tests.faults.fleet import RUNNING, make_fleet, submit_many
from worker.core.process import CUDA_FAULT_EXIT

pytestmark = pytest.mark.slow


def test_a_worker_for_interactive_jobs_alone_leaves_bulk_ones_to_another(fleet, inputs):
    """And the API is ready only once every queue has a worker (issue #37: `/readyz` said
    ready some 20 s before any worker was there)."""
    assert fleet.readiness() == "unavailable"
    bulk = submit_many(fleet, inputs, 2)
    interactive = submit_many(fleet, inputs, 2, priority="interactive")
    fleet.start_worker(None, "--queues", "interactive")
    fleet.wait_all(interactive)
    assert fleet.readiness() == "unavailable"  # none takes bulk jobs
    assert {fleet.store.get(i).status for i in bulk} == {"queued"}
    assert fleet.redis.llen("bulk") == 2  # still queued, not taken and held
    fleet.start_worker(None, "--queues", "bulk")
    fleet.wait_readiness("ok")
    fleet.wait_all(bulk)
    tally = fleet.tally(bulk + interactive)
    assert (tally.succeeded, tally.duplicates, tally.lost) == (4, 0, 0)


def test_one_worker_per_gpu_and_a_dead_one_is_started_again(fleet, inputs):
    supervisor = fleet.start_worker(None, "--gpus", "0,1")
    try:

        def workers() -> list[psutil.Process]:
            return psutil.Process(supervisor.pid).children()

        deadline = time.monotonic() + 60
        while len(workers()) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        first = workers()
        assert len(first) == 2
        first[0].kill()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            pids = {p.pid for p in workers()}
            if len(pids) == 2 and first[0].pid not in pids:
                break
            time.sleep(0.2)
        assert len(pids) == 2 and first[0].pid not in pids and first[1].pid in pids
        ids = submit_many(fleet, inputs, 4)
        fleet.wait_all(ids)
        tally = fleet.tally(ids)
        assert (tally.succeeded, tally.duplicates, tally.lost) == (4, 0, 0)
    finally:
        supervisor.terminate()  # drains both workers
        assert supervisor.wait(timeout=120) == 0
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in first[1:])


def test_a_job_that_kills_its_process_every_time_is_failed_as_poison(
    tmp_path, storage_server, inputs
):
    """Every start of the job kills the process that runs it (failpoint `after_start`). The
    first kills its worker, whose supervisor starts a new one: an unexplained death, which
    sends the job to the quarantine lane. There it runs alone, in a process of its own, and
    kills it each time: after MAX_ATTEMPTS such deaths it is poison, and the worker itself
    was not killed again."""
    fleet = make_fleet(tmp_path, storage_server, MAX_ATTEMPTS=2)
    try:
        [job] = submit_many(fleet, inputs, 1)
        fleet.start_worker("after_start", "--gpus", "0")
        fleet.wait_all([job], timeout=240)
        tally = fleet.tally([job])
        assert (tally.failed, tally.lost) == (1, 0)
        record = fleet.store.get(job)
        assert record.error.code == "poison" and record.quarantined
        assert record.quarantine_deaths == 2 and record.attempts == 3
        assert fleet.logs().count("restarting it") == 1
    finally:
        fleet.close()


def test_a_good_job_whose_workers_are_killed_under_it_is_not_failed(tmp_path, storage_server):
    """Its worker is `kill -9`ed under it three times, once in the main lane and twice while
    it runs in quarantine, more often than MAX_ATTEMPTS: those deaths say nothing about the
    job, which then succeeds. Each killed worker's other processes go with it: its engine core
    and its quarantine process."""
    fleet = make_fleet(tmp_path, storage_server, MAX_ATTEMPTS=2)
    try:
        [job] = [fleet.submit(long_speech(66))]
        for _ in range(3):
            worker = fleet.start_worker()
            fleet.wait_until_running_on(job, worker.pid, timeout=180)
            time.sleep(0.5)
            children = psutil.Process(worker.pid).children(recursive=True)
            worker.kill()
            worker.wait()
            gone, alive = psutil.wait_procs(children, timeout=10)
            assert not alive, [p.cmdline() for p in alive]
        fleet.start_worker()
        fleet.wait_all([job], timeout=240)
        tally = fleet.tally([job])
        assert (tally.succeeded, tally.duplicates, tally.lost) == (1, 0, 0)
        record = fleet.store.get(job)
        assert record.quarantined and record.quarantine_deaths == 0 and record.attempts == 4
    finally:
        fleet.close()
        print(fleet.logs()[-15000:])


def test_a_worker_whose_engine_core_dies_ends_and_its_jobs_are_taken_over(tmp_path, storage_server):
    """The engine core (the worker's spawned child that holds the model) is `kill -9`ed mid-job,
    as the OOM killer or a GPU fault would end it: the worker ends too, with exit 70 (its
    supervisor starts a new one), and a new worker takes the job over and runs it once."""
    fleet = make_fleet(tmp_path, storage_server)
    try:
        job = fleet.submit(long_speech(66))
        worker = fleet.start_worker()
        fleet.wait_until_running_on(job, worker.pid, timeout=180)
        children = psutil.Process(worker.pid).children()
        [core] = [p for p in children if "spawn_main" in " ".join(p.cmdline())]
        core.kill()
        assert worker.wait(timeout=15) == CUDA_FAULT_EXIT
        fleet.start_worker()
        fleet.wait_all([job], timeout=240)
        tally = fleet.tally([job])
        assert (tally.succeeded, tally.duplicates, tally.lost) == (1, 0, 0)
        assert "the engine core ended" in fleet.logs()
    finally:
        fleet.close()


def test_job_processes_share_one_engine_core_and_outlive_each_other(fleet, inputs):
    """`whisperfleet worker --processes 2`: one engine core, warm before either job process
    starts, fed by both. A job process `kill -9`ed mid-batch is started again and its jobs are
    taken over, each run once, while the core and the other process go on; `kill -9` of the
    worker itself then leaves no process behind: the core reads its owner's end and exits,
    and the job processes end with their core."""
    port = free_port(3)
    metrics = {"WHISPERFLEET_METRICS_PORT": str(port)}
    worker = fleet.start_worker(None, "--processes", "2", env=metrics)
    try:

        def children() -> tuple[list[psutil.Process], list[psutil.Process]]:
            procs = psutil.Process(worker.pid).children()
            cores = [p for p in procs if "spawn_main" in " ".join(p.cmdline())]
            jobs = [p for p in procs if "worker.cli" in p.cmdline()]
            return cores, jobs

        deadline = time.monotonic() + 180
        while len(children()[1]) < 2:
            assert time.monotonic() < deadline and worker.poll() is None, "no job processes"
            time.sleep(0.2)
        deadline = time.monotonic() + 180
        while httpx.get(f"http://127.0.0.1:{port}/ready").status_code != 200:
            assert time.monotonic() < deadline and worker.poll() is None, "never ready"
            time.sleep(0.2)
        # ready once both job processes have found the one core warm: they take jobs
        deadline = time.monotonic() + 5
        while any(
            httpx.get(f"http://127.0.0.1:{p}/ready").status_code != 200
            for p in (port + 1, port + 2)
        ):
            assert time.monotonic() < deadline, "ready before its job processes"
            time.sleep(0.05)
        time.sleep(2)  # the core's first report
        owner, job = (httpx.get(f"http://127.0.0.1:{p}/metrics").text for p in (port, port + 1))
        # the engine's series once, on the worker's port; each job process's jobs on its own
        assert "whisperfleet_engine_busy_seconds_total" in owner
        assert "whisperfleet_engine_busy_seconds_total" not in job
        assert "whisperfleet_running_jobs" in job and "whisperfleet_running_jobs" not in owner
        [core], first = children()
        ids = submit_many(fleet, inputs, 16)
        fleet.wait_until(ids, RUNNING, 4, timeout=120)
        victim = next(
            p for p in first if any(fleet.store.get(i).worker.endswith(f":{p.pid}") for i in ids
                                    if fleet.store.get(i).status == "running")
        )  # fmt: skip
        victim.kill()
        fleet.wait_all(ids)
        tally = fleet.tally(ids)
        assert (tally.succeeded, tally.duplicates, tally.lost) == (16, 0, 0)
        ran_on = {fleet.store.get(i).worker.rpartition(":")[2] for i in ids}
        assert len(ran_on) >= 2, ran_on  # both processes fed the one core
        cores, jobs = children()
        assert [p.pid for p in cores] == [core.pid]  # the core outlived the job process
        assert victim.pid not in {p.pid for p in jobs} and len(jobs) == 2  # started again
        loads = [line for line in fleet.logs().splitlines() if "model tiny.en ready in" in line]
        assert sum(f"[{core.pid} " in line for line in loads) == 1  # once, in the one core;
        # the others ran the killed process's jobs alone, each in a quarantine process
        assert fleet.logs().count("loaded and warm") == 3  # each job process found it so

        # only the core imports torch: the job processes, having read inputs and sent and
        # received their calls, and the owner never load it (their starts overlap the core's)
        def torch_loaded(process: psutil.Process) -> bool:
            return any("libtorch" in m.path for m in process.memory_maps())

        assert torch_loaded(core)
        assert not any(map(torch_loaded, [psutil.Process(worker.pid), *jobs]))
        everything = psutil.Process(worker.pid).children(recursive=True)
    finally:
        worker.kill()
        worker.wait()
    gone, alive = psutil.wait_procs(everything, timeout=15)
    assert not alive, [p.cmdline() for p in alive]
