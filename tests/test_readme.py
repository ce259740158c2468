"""CI must run exactly the test command the README gives."""

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent


def readme_command(label: str) -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(rf"\*\*\({label}\)[^`]*```bash\n(.+?)\n```", text, re.S)
    assert match, f"README has no command ({label})"
    return match.group(1)


def test_ci_runs_the_readme_test_command():
    command = readme_command("b")
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert command in ci_lines


def test_main_job_command_runs_the_quickstart():
    assert "examples/quickstart.sh" in readme_command("a")
    assert (ROOT / "examples" / "quickstart.sh").stat().st_mode & 0o111
