"""The seams hold: nothing outside `engine/` uses a name private to it (callers hold the front
door, `Engine.open(config) -> Stream`), the worker's light contract imports no torch, and the
engine implements every option value the contract offers."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
OUTSIDE = ("api", "worker", "scripts", "tests")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def engine_private_names() -> set[str]:
    """Functions, classes, module globals and attributes that engine/ keeps to itself."""
    names = set()
    for path in (ROOT / "engine").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and _private(node.name):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if _private(node.attr):
                    names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                if _private(node.id):
                    names.add(node.id)
    return names


def uses(path: Path, private: set[str]) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("engine"):
            found += [f"imports {a.name}" for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Attribute) and node.attr in private:
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            if owner not in ("self", "cls"):
                found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "setattr":
            named = [a.value for a in node.args if isinstance(a, ast.Constant)]
            found += [f"line {node.lineno}: setattr {n}" for n in named if n in private]
    return found


def test_nothing_outside_the_engine_touches_its_private_names():
    private = engine_private_names()
    assert {"_admit", "_graph", "_prefill"} <= private  # the scan sees the engine's own
    offenders = {
        str(path.relative_to(ROOT)): found
        for folder in OUTSIDE
        for path in (ROOT / folder).rglob("*.py")
        if (found := uses(path, private))
    }
    assert offenders == {}


def test_the_contract_imports_neither_torch_nor_fastapi():
    modules = sorted(p.stem for p in (ROOT / "worker" / "contract").glob("*.py"))
    code = (
        f"import sys; import {', '.join(f'worker.contract.{m}' for m in modules)}; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'engine', 'fastapi', 'numpy')); print(','.join(bad)); sys.exit(bool(bad))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, f"imported: {result.stdout} {result.stderr[-2000:]}"


def test_a_job_process_imports_no_torch():
    """A job process reads inputs (`engine.host`) and sends them to its engine core, which
    alone imports torch: eight job processes importing it beside the core made a restart
    twice as slow (docs/benchmarks.md)."""
    code = (
        "import sys; import worker.lifecycle, worker.transcripts, engine.host; "
        "from engine import AudioError, InputTooLong, OptionsError, SpectrogramError, "
        "Transcription, TranscriptionOptions; "
        "print('torch' in sys.modules); sys.exit('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, f"imported torch: {result.stdout} {result.stderr[-2000:]}"


def test_the_engine_implements_the_options_the_contract_offers():
    """The engine may not import the contract: its modes and tasks are checked here instead."""
    from engine.loader import random_tokenizer
    from engine.longform import REQUESTS
    from worker.contract.options import Mode, Task, values

    assert set(values(Mode)) == set(REQUESTS)
    assert set(values(Task)) == set(random_tokenizer("tiny").task_ids)


def test_the_settings_offer_what_the_engine_config_takes():
    """The settings (light) and EngineConfig each declare these values; they must agree."""
    from typing import get_args

    from engine.engine import CrossKV, Kernels
    from worker.contract.settings import Settings

    for field, alias in (("cross_kv", CrossKV), ("kernels", Kernels)):
        assert get_args(Settings.model_fields[field].annotation) == get_args(alias)
