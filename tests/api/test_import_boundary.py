"""The API image stays small: importing the app must not import torch or the engine."""

from tests.test_layers import imported


def test_api_imports_neither_torch_nor_engine():
    code = "import api.main, api.routes.jobs, api.upload"
    assert imported(code, ("torch", "engine", "transformers", "numpy", "soundfile")) == []
