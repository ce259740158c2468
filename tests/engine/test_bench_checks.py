"""The bench's real-weight checks (`whisperfleet bench --real`): each has a rule that can fail,
and without CUDA the GPU's checks say they did not run, never that they passed."""

import torch

from tests.conftest import DATA
from tools.evaluate import read_manifest
from tools.gpu_checks import GPU_CHECKS, Report, check_model


def test_without_cuda_only_the_reference_runs_and_nothing_passes_for_the_gpu():
    clips = [c for c in read_manifest(DATA / "manifest.jsonl") if c.seconds <= 12][:2]
    report = check_model("tiny.en", clips, torch.device("cpu"))
    (what, value, ok), *gpu = report.lines
    assert what == "WER fp32 CPU (2 English clips)" and value.endswith(" %") and ok is None
    assert [line[0] for line in gpu] == list(GPU_CHECKS)
    assert all(value == "not run: needs CUDA, not cpu" and ok is None for _, value, ok in gpu)


def test_the_rules_fail_on_a_difference():
    report = Report("tiny.en")
    report.same("tokens", [[1, 2], [3]], [[1, 2], [3]])
    report.within("WER", 6.5, 6.24)
    assert report.passed
    report.same("tokens", [[1, 2], [3, 4]], [[1, 2], [3]])
    assert report.lines[-1] == ("tokens", "1/2", False) and not report.passed
    other = Report("tiny.en")
    other.within("WER", 6.6, 6.24)
    assert other.lines[-1] == ("WER", "6.60 %", False) and not other.passed
