"""The tool registry: tools found by name, the schemas the model sees, registration."""

from __future__ import annotations

import shutil

import pytest

from cuda_agent.agent.tools import TOOLS, Tool, Toolbox, ToolError, ToolResult, get_tool, register, tool_names
from cuda_agent.agent.tools import registry
from cuda_agent.agent.tools.files import Read

SANDBOX = "auto" if shutil.which("bwrap") else "none"
ORDER = ("bash", "bash_output", "kill_job", "read", "write", "edit", "multi_edit", "glob", "grep", "todo_write")


@pytest.fixture
def box(tmp_path):
    (tmp_path / "model.py").write_text("x = 1\n")
    with Toolbox(tmp_path, sandbox=SANDBOX, command_timeout_s=42, max_output_chars=1234) as toolbox:
        yield toolbox


def test_a_tool_is_found_by_name():
    tool = get_tool("read")
    assert isinstance(tool, Read) and isinstance(tool, Tool) and tool.name == "read"
    assert TOOLS["read"] is tool
    for name in tool_names():
        assert get_tool(name).name == name


def test_an_unknown_name_is_an_error_listing_the_known_ones():
    with pytest.raises(ToolError) as caught:
        get_tool("frobnicate")
    assert str(caught.value) == f"unknown tool 'frobnicate'; the tools are: {', '.join(ORDER)}"


def test_the_model_sees_the_registered_schemas_in_a_stable_order(box, tmp_path):
    assert tool_names() == ORDER and tuple(TOOLS) == ORDER
    schemas = box.schemas()
    assert schemas == [get_tool(name).schema(box) for name in ORDER]
    assert [schema["function"]["name"] for schema in schemas] == list(ORDER)
    with Toolbox(tmp_path, sandbox=SANDBOX) as other:  # other limits, other descriptions; same tools, same order
        assert [schema["function"]["name"] for schema in other.schemas()] == list(ORDER)
    bash = schemas[0]["function"]
    assert "default 42 s" in bash["description"] and "longer than 1234 characters" in bash["description"]


def test_schemas_are_copies(box):
    box.schemas()[3]["function"]["parameters"]["required"].append("colour")
    assert box.schemas()[3]["function"]["parameters"]["required"] == ["path"]
    assert get_tool("read").parameters["required"] == ["path"]


def test_a_tool_validates_its_own_arguments(box):
    read = get_tool("read")
    assert read.parse(box, '{"path": "model.py", "limit": 2.0}') == {"path": "model.py", "limit": 2}
    assert read.parse(box, {"path": "x"}) == {"path": "x"}
    assert get_tool("todo_write").parse(box, '{"todos": []}') == {"todos": []}
    with pytest.raises(ToolError, match="^read: missing required argument 'path'"):
        read.parse(box, "")  # some models send "" for no arguments
    with pytest.raises(ToolError, match="^read: path must be a string"):
        read.parse(box, {"path": 7})
    with pytest.raises(ToolError, match="^the arguments of read are not valid JSON"):
        read.parse(box, "{")


def test_registering_a_duplicate_name_fails():
    before = dict(TOOLS)

    class Impostor(Tool):
        def call(self, box, **arguments):
            return ToolResult("impostor")

    with pytest.raises(ValueError, match=r"'read' is registered already \(cuda_agent\.agent\.tools\.files\.Read\)"):
        register("read")(Impostor)
    with pytest.raises(TypeError, match="subclass of Tool"):
        register("not_a_tool")(object)
    assert dict(TOOLS) == before and tool_names() == ORDER and Impostor.name == ""


def test_a_registered_tool_is_offered_and_called(box):
    try:
        @register("echo")
        class Echo(Tool):
            description = "Say it back."
            parameters = registry.object_schema({"text": {"type": "string", "description": "What to say."}},
                                                ["text"])

            def call(self, box, text):
                return ToolResult(text.upper())

        assert box.schemas()[-1]["function"] == {"name": "echo", "description": "Say it back.",
                                                  "parameters": Echo.parameters}
        assert box.call("echo", '{"text": "hi"}') == ToolResult("HI")
        assert "missing required argument 'text'" in box.call("echo", "{}").content
    finally:
        registry._TOOLS.pop("echo", None)
    assert tool_names() == ORDER
    assert "unknown tool 'echo'" in box.call("echo", '{"text": "hi"}').content
