"""The persistent sandboxed shell, background jobs, and the sandbox's read-only binds."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from cuda_agent.agent.shell import BackgroundJob, OutputReader, Shell, ansi_c_quote
from cuda_agent.sandbox import Limits, make_sandbox

SANDBOX = "auto" if shutil.which("bwrap") else "none"
needs_bwrap = pytest.mark.skipif(SANDBOX == "none", reason="bwrap is not installed")
ENV = {"PATH": os.environ["PATH"], "LANG": "C.UTF-8"}

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def sandbox():
    return make_sandbox(SANDBOX)


@pytest.fixture
def shell(sandbox, tmp_path):
    sh = Shell(sandbox, tmp_path, ENV)
    yield sh
    sh.close()


@pytest.mark.parametrize("text", ["plain", "it's \"quoted\" \\ back\\slash", "two\nlines\ttab", "$HOME `id` $(id)",
                                  "ünïcødé ✓", "'", "\\", "trailing\\"])
def test_ansi_c_quote_round_trips_through_bash(text):
    out = subprocess.run(["bash", "-c", f"printf %s {ansi_c_quote(text)}"], capture_output=True, check=True)
    assert out.stdout.decode() == text


def test_state_persists_between_commands(shell, tmp_path):
    (tmp_path / "sub").mkdir()
    assert shell.run("cd sub && export GREETING='hi there'; x=local", 30).exit_code == 0
    result = shell.run("pwd; echo \"$GREETING\"; echo $x", 30)
    assert result.output == f"{tmp_path / 'sub'}\nhi there\nlocal\n"
    assert result.exit_code == 0 and not result.timed_out


def test_exit_codes_and_exact_output(shell):
    assert shell.run("false", 30).exit_code == 1
    assert shell.run("(exit 42)", 30).exit_code == 42
    result = shell.run("printf 'no newline'", 30)
    assert (result.output, result.exit_code) == ("no newline", 0)
    assert shell.run("echo out; echo err >&2", 30).output == "out\nerr\n"  # stderr is merged


def test_bad_syntax_and_stdin_readers_do_not_wedge_the_shell(shell):
    result = shell.run("echo 'unbalanced", 30)
    assert result.exit_code == 2 and "unexpected EOF" in result.output
    # stdin is /dev/null: cat ends at once instead of eating the commands that follow.
    assert shell.run("cat; read line; echo read=$?", 30).output == "read=1\n"
    assert shell.run("echo still here", 30).output == "still here\n"


def test_trace_output_does_not_show_the_sentinel(shell):
    result = shell.run("set -x; echo traced", 30)
    assert result.exit_code == 0 and "traced\n" in result.output
    assert "__CUDA_AGENT_DONE_" not in result.output


def test_exit_ends_the_shell_and_the_next_command_gets_a_fresh_one(shell, tmp_path):
    shell.run("cd / && export GONE=1", 30)
    result = shell.run("echo bye; exit 3", 30)
    assert result.shell_exited and result.exit_code == 3 and result.output == "bye\n"
    assert not shell.alive
    assert shell.run("pwd; echo ${GONE:-unset}", 30).output == f"{tmp_path}\nunset\n"


def test_timeout_kills_everything_in_the_shell_and_a_new_one_works(shell, tmp_path):
    started = time.monotonic()
    result = shell.run("(sleep 2; touch late) & echo started; sleep 60", 1)
    assert result.timed_out and result.exit_code is None and result.output == "started\n"
    assert time.monotonic() - started < 20
    assert shell.run("echo again", 30).output == "again\n"
    time.sleep(3)
    assert not (tmp_path / "late").exists()  # the background subshell died with the timed-out shell


def test_output_beyond_the_buffer_keeps_head_and_tail(sandbox, tmp_path):
    sh = Shell(sandbox, tmp_path, ENV, buffer_bytes=100_000)
    try:
        result = sh.run("echo START; head -c 3000000 /dev/zero | tr '\\0' a; echo; echo END", 60)
    finally:
        sh.close()
    assert result.exit_code == 0
    assert result.head.startswith("START\n") and result.tail.endswith("\nEND\n")
    assert len(result.head) + len(result.tail) <= 100_000
    assert result.dropped == len("START\n") + 3_000_001 + len("END\n") - len(result.head) - len(result.tail)


def test_output_reader_gap_accounting():
    read_end, write_end = os.pipe()
    with os.fdopen(read_end, "rb") as stream:
        reader = OutputReader(stream, cap=2048)
        reader.start()
        os.write(write_end, b"h" * 1024 + b"m" * 5000 + b"t" * 1024)
        os.close(write_end)
        reader.join(timeout=10)
        with reader.changed:
            head, tail, dropped = reader.take()
    assert head == "h" * 1024 and tail == "t" * 1024 and dropped == 5000


def test_background_job_inherits_cwd_and_exports_and_reports_its_exit(shell, sandbox, tmp_path):
    (tmp_path / "sub").mkdir()
    shell.run("cd sub; export FLAVOUR=mint", 30)
    cwd, exports = shell.snapshot()
    assert cwd == str(tmp_path / "sub")
    job = BackgroundJob.start("1", "pwd; echo $FLAVOUR; sleep 1; echo done; exit 5", sandbox, cwd=tmp_path,
                              shell_cwd=cwd, exports=exports, env=ENV)
    deadline = time.monotonic() + 30
    seen = ""
    while job.running and time.monotonic() < deadline:
        time.sleep(0.1)
        seen += job.poll()[0]
    head, _, _, code = job.poll()
    seen += head
    assert seen == f"{tmp_path / 'sub'}\nmint\ndone\n" and code == 5
    assert job.poll()[0] == ""  # polled output is not repeated


def test_killed_background_job(sandbox, tmp_path):
    job = BackgroundJob.start("1", "echo up; sleep 60", sandbox, cwd=tmp_path, shell_cwd=None, exports=None,
                              env=ENV)
    deadline = time.monotonic() + 30
    while "up" not in job.poll()[0] and time.monotonic() < deadline:
        time.sleep(0.05)
    job.kill()
    assert not job.running and job.killed and job.describe_exit() == "stopped by kill_job"


@needs_bwrap
def test_read_only_paths_win_over_the_writable_workspace(sandbox, tmp_path):
    (tmp_path / "fixed.txt").write_text("original\n")
    (tmp_path / "fixed_dir").mkdir()
    (tmp_path / "fixed_dir" / "inner.txt").write_text("inner\n")
    argv = sandbox.bwrap_argv(["true"], cwd=tmp_path, gpu=False, read_only=[tmp_path / "fixed.txt"])
    assert argv.index("--bind") < argv.index("--ro-bind", argv.index("--bind"))
    proc = sandbox.spawn(
        ["bash", "-c", "echo x > fixed.txt; echo y > fixed_dir/inner.txt; echo z > fixed_dir/new.txt; "
                       "rm fixed.txt; echo ok > free.txt; echo finished"],
        cwd=tmp_path, env=ENV, limits=Limits(), gpu=False,
        read_only=[tmp_path / "fixed.txt", tmp_path / "fixed_dir"])
    output = proc.communicate(timeout=60)[0].decode()
    assert output.count("Read-only file system") == 3, output
    assert "finished" in output
    assert (tmp_path / "fixed.txt").read_text() == "original\n"
    assert (tmp_path / "fixed_dir" / "inner.txt").read_text() == "inner\n"
    assert not (tmp_path / "fixed_dir" / "new.txt").exists()
    assert (tmp_path / "free.txt").read_text() == "ok\n"
    with pytest.raises(FileNotFoundError, match="read-only path"):
        sandbox.spawn(["true"], cwd=tmp_path, env=ENV, limits=Limits(), gpu=False, read_only=[tmp_path / "absent"])
