"""Worker log lines name their job: as JSON objects for collectors, or as text."""

import json
import logging
import threading

import pytest

from worker.logs import configure, current_job


@pytest.fixture
def root_handlers():
    root = logging.getLogger()
    saved, level = root.handlers[:], root.level
    yield
    root.handlers[:] = saved
    root.setLevel(level)


def test_json_lines_carry_the_job_of_their_thread(capfd, root_handlers):
    configure("json")
    log = logging.getLogger("whisperfleet.test")

    def job(job_id: str) -> None:
        current_job.set(job_id)
        log.info("job %s started", job_id)

    threads = [threading.Thread(target=job, args=(f"job-{i}",)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.warning("not about a job")
    lines = [json.loads(x) for x in capfd.readouterr().err.splitlines()]
    assert sorted(x["job_id"] for x in lines[:3]) == ["job-0", "job-1", "job-2"]
    assert all(x["message"] == f"job {x['job_id']} started" for x in lines[:3])
    assert lines[3]["job_id"] is None and lines[3]["level"] == "WARNING"


def test_text_lines_name_the_job(capfd, root_handlers):
    configure("text")
    current_job.set("abc")
    logging.getLogger("whisperfleet.test").info("hello")
    current_job.set(None)
    assert "job=abc: hello" in capfd.readouterr().err
