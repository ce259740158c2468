"""The seams hold: the packages import one another only as their layers allow (worker/'s
subsystems as `worker/__init__.py` lists them) and never in a circle; nothing outside
`engine/` uses a name private to it (callers hold the front door, `Engine.open(config) ->
Stream`); the worker's light contract and its job processes import no torch; and the engine
implements every option value the contract offers.

`python -m pytest tests/test_layers.py` is the check; each failure names the imports."""

import ast
import subprocess
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).parent.parent
OUTSIDE = ("api", "worker", "tools", "scripts", "tests")
PACKAGES = ("api", "worker", "engine", "tools")
SHARED = ("app", "storage", "metrics", "logs", "failpoints")  # what worker/'s subsystems share

# each layer and the layers it may import (its own always)
BASE = {"worker.contract", "worker.shared"}
ALLOWED = {
    "engine": set(),
    "tools": {"engine"},
    "worker.contract": set(),
    "worker.shared": {"worker.contract"},
    "worker.core": BASE | {"engine"},
    "worker.jobs": BASE | {"worker.core", "worker.webhooks", "engine"},
    "worker.backfills": BASE,
    "worker.webhooks": BASE,
    "worker.local": BASE,
    "worker.cli": BASE
    | {f"worker.{s}" for s in ("core", "jobs", "backfills", "webhooks", "local")}
    | {"engine", "tools"},
    "api": BASE | {"worker.backfills", "worker.webhooks"},
}


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path, known: set[str], type_only: bool) -> set[str]:
    """The project's modules `path` imports, anywhere in it (in functions too); with
    `type_only`, also those under `if TYPE_CHECKING:` (names for annotations, never run)."""
    tree = ast.parse(path.read_text())
    skipped = set()
    if not type_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skipped |= {id(n) for child in node.body for n in ast.walk(child)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return found & known


def layer(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "worker":
        return parts[0]
    if len(parts) == 1 or parts[1] in SHARED:
        return "worker.shared"
    return f"worker.{parts[1]}"


def test_every_module_has_a_layer():
    assert {layer(m) for m in modules()} == set(ALLOWED)


def test_imports_follow_the_layers():
    found = modules()
    crossings = {
        f"{module} imports {other}"
        for module, path in found.items()
        for other in imports(path, set(found), type_only=True)
        if layer(other) != layer(module) and layer(other) not in ALLOWED[layer(module)]
    }
    assert crossings == set()


def test_no_imports_run_in_a_circle():
    found = modules()
    graph = {m: imports(p, set(found), type_only=False) - {m} for m, p in found.items()}
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as e:
        raise AssertionError(f"imports run in a circle: {' -> '.join(e.args[1])}") from None


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


def imported(code: str, packages: tuple[str, ...]) -> list[str]:
    """The modules of `packages` that running `code` in a fresh interpreter imports."""
    found = f"sorted(m for m in sys.modules if m.split('.')[0] in {packages!r})"
    probe = f"import sys\n{code}\nprint({found})"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    return ast.literal_eval(result.stdout.strip().splitlines()[-1])


def test_the_contract_imports_neither_torch_nor_fastapi():
    modules = sorted(p.stem for p in (ROOT / "worker" / "contract").glob("*.py"))
    code = f"import {', '.join(f'worker.contract.{m}' for m in modules)}"
    assert imported(code, ("torch", "engine", "fastapi", "numpy")) == []


def test_a_job_process_imports_no_torch():
    """A job process reads inputs (`engine.host`) and sends them to its engine core, which
    alone imports torch: eight job processes importing it beside the core made a restart
    twice as slow (docs/benchmarks.md)."""
    code = (
        "import worker.jobs.lifecycle, worker.core.transcripts, engine.host\n"
        "from engine import AudioError, InputTooLong, OptionsError, SpectrogramError, "
        "Transcription, TranscriptionOptions"
    )
    assert imported(code, ("torch",)) == []


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

    from engine.config import CrossKV, Kernels
    from worker.contract.settings import Settings

    for field, alias in (("cross_kv", CrossKV), ("kernels", Kernels)):
        assert get_args(Settings.model_fields[field].annotation) == get_args(alias)
