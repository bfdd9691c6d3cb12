"""A closed pipe (``deepinfer backends --json | head -1``, generate into ``head``) ends quietly: no traceback,
the conventional SIGPIPE status."""

import os
import subprocess
import sys

import pytest

from deepinfer.cli import CLOSED_PIPE_STATUS


def _with_stdout_closed(args: list[str]) -> tuple[int, str]:
    """Run ``deepinfer ARGS`` whose stdout reader has gone before it writes; (status, stderr)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    proc = subprocess.Popen([sys.executable, "-m", "deepinfer.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.close()  # the reader is gone before the interpreter has even started
    err = proc.stderr.read().decode()
    proc.stderr.close()
    return proc.wait(timeout=300), err


@pytest.mark.parametrize("args", [["backends", "--json"], ["backends"], ["generate", "--prompt", "Hello", "--max-tokens", "3"]],
                         ids=["backends-json", "backends", "generate"])
def test_a_closed_pipe_ends_quietly(args):
    status, err = _with_stdout_closed(args)
    assert status in (0, CLOSED_PIPE_STATUS), err
    assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err, err


def test_head_reads_the_first_line_and_the_pipeline_is_quiet():
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.run(f"{sys.executable} -m deepinfer.cli backends --json | head -1", shell=True, capture_output=True, text=True, env=env)
    assert proc.stdout == "[\n" and proc.returncode == 0 and proc.stderr == ""
