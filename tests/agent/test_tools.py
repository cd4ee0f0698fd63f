"""The agent's tools through ``Toolbox.call``, as the loop uses them."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from cuda_agent.agent.tools import READ_MAX_LINES, Toolbox, ToolResult, clip, glob_regex

SANDBOX = "auto" if shutil.which("bwrap") else "none"
needs_bwrap = pytest.mark.skipif(SANDBOX == "none", reason="only the bwrap sandbox enforces read-only files")
PROTECTED = ("SKILL.md", "model.py", "binding.cpp", "binding_registry.h", "utils")
TOOLS = {"bash", "bash_output", "kill_job", "read", "write", "edit", "multi_edit", "glob", "grep", "todo_write"}

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def workspace(tmp_path):
    root = tmp_path / "ws"
    (root / "kernels").mkdir(parents=True)
    (root / "utils").mkdir()
    (root / "model.py").write_text("import torch\n\n\nclass Model(torch.nn.Module):\n    pass\n")
    (root / "utils" / "compile.py").write_text("print('compile')\n")
    (root / "kernels" / "add.cu").write_text("__global__ void add() {}\n// TODO tune\n")
    (root / "kernels" / "add_binding.cpp").write_text("// binding\n#include <torch/extension.h>\n")
    (root / "model_new.py").write_text("class ModelNew:\n    pass  # TODO\n")
    return root


@pytest.fixture
def box(workspace):
    with Toolbox(workspace, protected=PROTECTED, sandbox=SANDBOX, command_timeout_s=30,
                 max_output_chars=2000) as toolbox:
        yield toolbox


def call(box: Toolbox, name: str, **arguments) -> ToolResult:
    result = box.call(name, json.dumps(arguments))
    assert isinstance(result, ToolResult) and isinstance(result.content, str)
    return result


def wait_for_exit(box: Toolbox, job_id: str, timeout_s: float = 30) -> str:
    seen, deadline = "", time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = call(box, "bash_output", job_id=job_id)
        seen += result.content
        if not result.metadata["running"]:
            return seen
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} did not finish: {seen}")


# ----------------------------------------------------------------------------- schemas and bad calls

def test_schemas_are_valid_function_schemas(box):
    schemas = box.schemas()
    assert {s["function"]["name"] for s in schemas} == TOOLS and len(schemas) == len(TOOLS)
    json.dumps(schemas)
    for schema in schemas:
        assert schema["type"] == "function"
        function = schema["function"]
        assert function["description"].strip()
        parameters = function["parameters"]
        assert parameters["type"] == "object" and parameters["required"]
        assert set(parameters["required"]) <= set(parameters["properties"])
        for prop in parameters["properties"].values():
            assert prop["type"] in {"string", "integer", "number", "boolean", "array", "object"}
    by_name = {s["function"]["name"]: s["function"]["parameters"] for s in schemas}
    assert by_name["bash"]["required"] == ["command"]
    assert by_name["edit"]["required"] == ["path", "old_string", "new_string"]
    assert by_name["todo_write"]["properties"]["todos"]["items"]["properties"]["status"]["enum"] == [
        "pending", "in_progress", "completed"]


def test_bad_calls_are_errors_that_name_the_problem(box):
    result = box.call("read", '{"path": "model.py"')
    assert result.error and "not valid JSON" in result.content
    result = box.call("frobnicate", "{}")
    assert result.error and "unknown tool 'frobnicate'" in result.content and "bash" in result.content
    result = box.call("read", "{}")
    assert result.error and "missing required argument 'path'" in result.content
    result = box.call("edit", {"path": "model_new.py", "old_string": "x"})
    assert result.error and "'new_string'" in result.content
    result = box.call("read", {"path": 7})
    assert result.error and "path must be a string" in result.content
    result = box.call("bash", {"command": "true", "background": "yes"})
    assert result.error and "background must be true or false" in result.content
    result = box.call("read", {"path": "model.py", "colour": "red"})
    assert result.error and "unknown argument colour" in result.content
    result = box.call("todo_write", {"todos": [{"content": "x", "status": "started"}]})
    assert result.error and "todos[0].status must be one of" in result.content
    result = box.call("read", "[1, 2]")
    assert result.error and "JSON object" in result.content
    result = box.call("read", {"path": "model.py", "limit": 2.0})  # integral floats are integers
    assert not result.error and "2\t" in result.content
    # Calls that break the schema are marked apart from actions that failed (training drops the former).
    assert box.call("frobnicate", "{}").metadata["invalid_call"]
    assert box.call("read", "{}").metadata["invalid_call"]
    failed = box.call("read", {"path": "no_such_file.py"})
    assert failed.error and not failed.metadata.get("invalid_call")


# ----------------------------------------------------------------------------- bash

def test_bash_keeps_cwd_and_exports_between_calls(box, workspace):
    assert call(box, "bash", command="cd kernels && export ARCH=sm_90").content == "(no output)\nexit code 0"
    result = call(box, "bash", command="pwd; echo $ARCH; ls")
    assert result.content == f"{workspace}/kernels\nsm_90\nadd.cu\nadd_binding.cpp\nexit code 0"
    assert not result.error and result.metadata["exit_code"] == 0


def test_bash_reports_exit_codes(box):
    result = call(box, "bash", command="echo oops >&2; exit_status=7; (exit $exit_status)")
    assert result.error and result.content == "oops\nexit code 7" and result.metadata["exit_code"] == 7
    result = call(box, "bash", command="exit 4")
    assert result.error and "exit code 4" in result.content and "fresh shell" in result.content
    assert call(box, "bash", command="echo back").content == "back\nexit code 0"


def test_bash_timeout_kills_and_the_next_call_works(box, workspace):
    call(box, "bash", command="cd kernels")
    started = time.monotonic()
    result = call(box, "bash", command="echo begun; sleep 60", timeout_s=1)
    assert time.monotonic() - started < 20
    assert result.error and result.metadata["timed_out"] and result.metadata["exit_code"] is None
    assert result.content.startswith("begun\n") and "timed out after 1 s" in result.content
    assert "fresh shell" in result.content
    result = call(box, "bash", command="pwd")
    assert result.content == f"{workspace}\nexit code 0"  # a fresh shell, back in the workspace


def test_bash_output_is_cut_in_the_middle_with_a_note(box):
    result = call(box, "bash", command="echo FIRST; seq 1 20000; echo LAST")
    text = result.content
    assert result.metadata["truncated"] and text.startswith("FIRST\n1\n2\n") and text.endswith("LAST\nexit code 0")
    total = len("FIRST\n") + sum(len(f"{n}\n") for n in range(1, 20001)) + len("LAST\n")
    assert f"{total - 2000} of {total} characters cut" in text
    assert len(text) < 2400


def test_background_job_start_poll_and_kill(box, workspace):
    call(box, "bash", command="cd kernels; export WHO=job")
    result = call(box, "bash", command="echo $WHO in $(pwd); sleep 0.5; echo finished; exit 3", background=True)
    assert not result.error and result.metadata["job_id"] == "1" and "bash_output" in result.content
    seen = wait_for_exit(box, "1")
    assert f"job in {workspace}/kernels\n" in seen and "finished\n" in seen and "exit code 3" in seen
    assert call(box, "bash_output", job_id="1").content.startswith("(no new output)")

    started = call(box, "bash", command="echo up; sleep 120", background=True).metadata["job_id"]
    assert started == "2"
    assert call(box, "bash_output", job_id="2").metadata["running"]
    result = call(box, "kill_job", job_id="2")
    assert not result.error and not result.metadata["running"] and "stopped by kill_job" in result.content
    result = call(box, "bash_output", job_id="9")
    assert result.error and "no background job '9'" in result.content and "1, 2" in result.content


def test_background_job_survives_a_foreground_timeout(box):
    job = call(box, "bash", command="sleep 2; echo survived", background=True).metadata["job_id"]
    assert call(box, "bash", command="sleep 60", timeout_s=0.5).metadata["timed_out"]
    assert "survived" in wait_for_exit(box, job)


def test_close_stops_background_jobs(workspace):
    box = Toolbox(workspace, protected=PROTECTED, sandbox=SANDBOX)
    call(box, "bash", command="sleep 120", background=True)
    job = box._jobs["1"]
    box.close()
    assert not job.running
    assert box.call("bash", {"command": "true"}).error


def test_host_secrets_stay_out_of_the_shell(workspace, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    with Toolbox(workspace, sandbox=SANDBOX, env={"EXTRA": "given"}) as box:
        result = call(box, "bash", command="echo ${OPENAI_API_KEY:-unset} $EXTRA; python -c 'print(1 + 1)'")
    assert result.content == "unset given\n2\nexit code 0"


# ----------------------------------------------------------------------------- protection and confinement

def test_protected_files_are_refused_by_the_tools(box, workspace):
    before = (workspace / "model.py").read_text()
    for name, args in [("write", {"path": "model.py", "content": "hacked"}),
                       ("edit", {"path": "model.py", "old_string": "pass", "new_string": "hacked"}),
                       ("multi_edit", {"path": str(workspace / "model.py"),
                                       "edits": [{"old_string": "pass", "new_string": "hacked"}]}),
                       ("write", {"path": "utils/compile.py", "content": "hacked"}),
                       ("write", {"path": "kernels/../utils/new.py", "content": "hacked"})]:
        result = call(box, name, **args)
        assert result.error and "is protected (read-only)" in result.content, (name, args, result.content)
    assert (workspace / "model.py").read_text() == before
    assert (workspace / "utils" / "compile.py").read_text() == "print('compile')\n"
    assert not (workspace / "utils" / "new.py").exists()
    assert "class Model" in call(box, "read", path="model.py").content  # still readable


def test_protected_file_reached_through_a_link_is_refused(box, workspace):
    os.symlink("model.py", workspace / "alias.py")
    result = call(box, "write", path="alias.py", content="hacked")
    assert result.error and "protected" in result.content
    assert "hacked" not in (workspace / "model.py").read_text()


@needs_bwrap
def test_protected_files_are_read_only_in_the_shell(box, workspace):
    result = call(box, "bash", command="echo x > model.py")
    assert result.error and "Read-only file system" in result.content
    result = call(box, "bash", command="echo y > utils/compile.py; rm -f utils/compile.py; touch utils/new.py")
    assert result.error and "Read-only file system" in result.content
    assert "class Model" in (workspace / "model.py").read_text()
    assert (workspace / "utils" / "compile.py").read_text() == "print('compile')\n"
    assert not (workspace / "utils" / "new.py").exists()
    result = call(box, "bash", command="echo ok > kernels/new.cu && cat kernels/new.cu model.py | head -1")
    assert result.content == "ok\nexit code 0"
    assert (workspace / "kernels" / "new.cu").read_text() == "ok\n"


def test_paths_outside_the_workspace_are_refused(box, workspace, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("top secret\n")
    os.symlink(secret, workspace / "link.txt")
    os.symlink(tmp_path, workspace / "linkdir")
    for name, args in [("read", {"path": "../secret.txt"}), ("read", {"path": str(secret)}),
                       ("read", {"path": "link.txt"}), ("read", {"path": "linkdir/secret.txt"}),
                       ("write", {"path": "link.txt", "content": "overwritten"}),
                       ("write", {"path": "../escaped.txt", "content": "x"}),
                       ("edit", {"path": "link.txt", "old_string": "top", "new_string": "no"}),
                       ("grep", {"pattern": "secret", "path": "linkdir"}),
                       ("glob", {"pattern": "*", "path": ".."})]:
        result = call(box, name, **args)
        assert result.error and "outside the workspace" in result.content and str(workspace) in result.content, (
            name, args, result.content)
        assert "top secret" not in result.content
    assert "through a symbolic link" in call(box, "read", path="link.txt").content
    assert secret.read_text() == "top secret\n" and not (tmp_path / "escaped.txt").exists()
    # Searching the workspace does not follow the links out of it either.
    assert "no matches" in call(box, "grep", pattern="top secret").content


def test_a_link_swapped_in_after_the_check_is_not_followed(box, workspace, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, workspace / "sneaky")
    box._resolve = lambda path: "sneaky/planted.txt"  # as if the link appeared right after the check
    result = call(box, "write", path="sneaky/planted.txt", content="x")
    assert result.error and "symbolic link" in result.content
    assert not (outside / "planted.txt").exists()


def test_a_fifo_does_not_hang_the_tools(box, workspace):
    os.mkfifo(workspace / "pipe")
    result = call(box, "read", path="pipe")
    assert result.error and "not a regular file" in result.content
    assert call(box, "write", path="pipe", content="x").error
    assert "no matches" in call(box, "grep", pattern="x", glob="pipe").content


# ----------------------------------------------------------------------------- files

def test_read_numbers_lines_and_pages(box, workspace):
    result = call(box, "read", path="model.py")
    assert result.content == ("     1\timport torch\n     2\t\n     3\t\n     4\tclass Model(torch.nn.Module):\n"
                              "     5\t    pass")
    result = call(box, "read", path="model.py", offset=4, limit=1)
    assert result.content.startswith("     4\tclass Model") and "call read with offset=5" in result.content
    (workspace / "long.txt").write_text("".join(f"{n}\n" for n in range(1, 2501)))
    with Toolbox(workspace, sandbox=SANDBOX, max_output_chars=10**6) as wide:
        result = call(wide, "read", path="long.txt")
        assert result.content.count("\n") == READ_MAX_LINES  # 2000 lines and the note
        assert f"lines 1-{READ_MAX_LINES} of 2500" in result.content and "offset=2001" in result.content
        assert call(wide, "read", path="long.txt", offset=2500).content == "  2500\t2500"
    result = call(box, "read", path="long.txt")  # max_output_chars=2000 stops it much earlier
    assert len(result.content) < 2300 and result.metadata["truncated"]
    assert f"offset={result.metadata['last'] + 1}" in result.content
    assert call(box, "read", path="long.txt", offset=9999).error
    assert "does not exist" in call(box, "read", path="nope.py").content
    assert "is a directory" in call(box, "read", path="kernels").content


def test_write_creates_parent_directories(box, workspace):
    result = call(box, "write", path="kernels/deep/er/new.cu", content="line 1\nline 2\n")
    assert not result.error and "created kernels/deep/er/new.cu" in result.content
    assert (workspace / "kernels" / "deep" / "er" / "new.cu").read_text() == "line 1\nline 2\n"
    result = call(box, "write", path=str(workspace / "model_new.py"), content="replaced")
    assert "overwrote model_new.py" in result.content
    assert (workspace / "model_new.py").read_text() == "replaced"


def test_edit_unique_missing_ambiguous_and_replace_all(box, workspace):
    path = workspace / "model_new.py"
    path.write_text("a = 1\nb = 2\na = 1\n")
    result = call(box, "edit", path="model_new.py", old_string="b = 2", new_string="b = 3")
    assert not result.error and path.read_text() == "a = 1\nb = 3\na = 1\n"
    assert "     2\tb = 3" in result.content
    result = call(box, "edit", path="model_new.py", old_string="a = 1", new_string="a = 9")
    assert result.error and "occurs 2 times" in result.content and "lines 1, 3" in result.content
    result = call(box, "edit", path="model_new.py", old_string="c = 4", new_string="c = 5")
    assert result.error and "not found" in result.content
    assert path.read_text() == "a = 1\nb = 3\na = 1\n"
    result = call(box, "edit", path="model_new.py", old_string="a = 1", new_string="a = 9", replace_all=True)
    assert not result.error and result.metadata["replacements"] == 2
    assert path.read_text() == "a = 9\nb = 3\na = 9\n"
    assert "does not exist" in call(box, "edit", path="absent.py", old_string="x", new_string="y").content


def test_multi_edit_is_all_or_nothing(box, workspace):
    path = workspace / "model_new.py"
    path.write_text("alpha\nbeta\ngamma\n")
    result = call(box, "multi_edit", path="model_new.py", edits=[
        {"old_string": "alpha", "new_string": "ALPHA"},
        {"old_string": "delta", "new_string": "DELTA"}])
    assert result.error and "edit 2 of 2" in result.content and "not found" in result.content
    assert path.read_text() == "alpha\nbeta\ngamma\n"
    result = call(box, "multi_edit", path="model_new.py", edits=[
        {"old_string": "alpha", "new_string": "beta"},
        {"old_string": "beta", "new_string": "BETA", "replace_all": True},  # sees the first edit's result
        {"old_string": "gamma", "new_string": "GAMMA"}])
    assert not result.error and path.read_text() == "BETA\nBETA\nGAMMA\n"
    assert call(box, "multi_edit", path="model_new.py", edits=[]).error


def test_glob(box, workspace):
    (workspace / "kernels" / "sub").mkdir()
    (workspace / "kernels" / "sub" / "deep.cu").write_text("")
    assert call(box, "glob", pattern="**/*.cu").content == "kernels/add.cu\nkernels/sub/deep.cu"
    assert call(box, "glob", pattern="*.cu", path="kernels").content == "kernels/add.cu"
    assert call(box, "glob", pattern="kernels/*.{cu,cpp}").content == "kernels/add.cu\nkernels/add_binding.cpp"
    assert call(box, "glob", pattern="*").content == "kernels/\nmodel.py\nmodel_new.py\nutils/"
    assert "no files match" in call(box, "glob", pattern="*.rs").content
    assert glob_regex("a/**/b?.[ch]").match("a/x/y/b1.h") and not glob_regex("*.py").match("dir/x.py")


def test_grep(box, workspace):
    result = call(box, "grep", pattern="TODO")
    assert result.content == "kernels/add.cu:2: // TODO tune\nmodel_new.py:2:     pass  # TODO"
    assert call(box, "grep", pattern="todo", glob="*.cu", ignore_case=True).content == "kernels/add.cu:2: // TODO tune"
    assert "no matches" in call(box, "grep", pattern="todo", glob="*.cu").content
    result = call(box, "grep", pattern="^class", path="model.py", context=1)
    assert result.content == "model.py-3- \nmodel.py:4: class Model(torch.nn.Module):\nmodel.py-5-     pass"
    result = call(box, "grep", pattern="(unclosed")
    assert result.error and "not a valid Python regular expression" in result.content


def test_todo_write_replaces_the_list(box):
    result = call(box, "todo_write", todos=[{"content": "write the kernel", "status": "in_progress"},
                                            {"content": "profile", "status": "pending"},
                                            {"content": "read model.py", "status": "completed"}])
    assert result.content == ("todo list (1/3 completed):\n[>] write the kernel\n[ ] profile\n"
                              "[x] read model.py")
    assert box.todos[0] == {"content": "write the kernel", "status": "in_progress"} and len(box.todos) == 3
    call(box, "todo_write", todos=[{"content": "only one", "status": "pending"}])
    assert box.todos == [{"content": "only one", "status": "pending"}]
    assert call(box, "todo_write", todos=[{"content": " ", "status": "pending"}]).error
    assert box.todos == [{"content": "only one", "status": "pending"}]


def test_clip_keeps_head_and_tail():
    assert clip("short", 100) == ("short", False)
    text, cut = clip("a" * 50 + "b" * 50, 20)
    assert cut and text.startswith("a" * 10) and text.endswith("b" * 10) and "80 of 100 characters cut" in text
    text, cut = clip("head", 20, "tail", missing=1000)
    assert cut and text.startswith("head") and text.endswith("tail") and "1000 of 1008" in text
