"""`whisperfleet worker --gpus all` counts the GPUs without touching CUDA itself."""

import os
import subprocess
import sys


def test_gpus_all_with_no_gpu_visible_says_so():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [sys.executable, "-m", "worker.cli", "worker", "--gpus", "all"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert "--gpus all, but no GPU is visible" in result.stderr
