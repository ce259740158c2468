"""The bench's real-weight checks (`whisperfleet bench --real`) run end to end; on the CPU
here (the GPU is where they mean something), over a few short clips."""

import torch

from engine.evaluate import read_manifest
from engine.gpu_checks import check_model
from tests.conftest import DATA


def test_real_weight_checks_pass_and_report_every_line():
    clips = [c for c in read_manifest(DATA / "manifest.jsonl") if c.seconds <= 12][:2]
    report = check_model("tiny.en", clips, torch.device("cpu"))
    assert [what.split(" (")[0] for what, _, _ in report.lines] == [
        "WER fp32 CPU",
        "greedy tokens, fp32 GPU == fp32 CPU",
        "WER fp16 GPU, graphs + Triton",
        "greedy tokens, graphs == eager",
        "greedy tokens, Triton == torch",
        "WER fp16 GPU, fp8 cross K/V",
        "WER bf16 GPU",
    ]
    assert report.passed, report.lines
    assert (
        dict((what, value) for what, value, _ in report.lines)[
            "greedy tokens, fp32 GPU == fp32 CPU"
        ]
        == "2/2"
    )  # on the CPU both sides are one code path
