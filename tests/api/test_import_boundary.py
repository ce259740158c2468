"""The API image stays small: importing the app must not import torch or the engine."""

import subprocess
import sys


def test_api_imports_neither_torch_nor_engine():
    code = (
        "import sys, api.main, api.routes.jobs, api.upload; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'engine', 'transformers', 'numpy', 'soundfile')); "
        "print(','.join(bad)); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, f"api imported: {result.stdout} {result.stderr[-2000:]}"
