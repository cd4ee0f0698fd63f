"""The todo tool: the model's plan and progress, kept on the toolbox (``Toolbox.todos``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cuda_agent.agent.tools.registry import Tool, ToolError, ToolResult, object_schema, register

if TYPE_CHECKING:
    from cuda_agent.agent.tools.toolbox import Toolbox

TODO_STATUSES = ("pending", "in_progress", "completed")
_MARKS = {"pending": "[ ]", "in_progress": "[>]", "completed": "[x]"}


@register("todo_write")
class TodoWrite(Tool):
    description = "Replace your todo list (plan and progress) with this one; returns it. Keep one item in_progress."
    parameters = object_schema({"todos": {"type": "array", "description": "The whole list.", "items": object_schema({
        "content": {"type": "string", "description": "What to do."},
        "status": {"type": "string", "enum": list(TODO_STATUSES)},
    }, ["content", "status"])}}, ["todos"])

    def call(self, box: Toolbox, todos: list[dict[str, str]]) -> ToolResult:
        for number, item in enumerate(todos, 1):
            if not item["content"].strip():
                raise ToolError(f"todo_write: item {number} has an empty content")
        box._todos = [{"content": item["content"].strip(), "status": item["status"]} for item in todos]
        if not box._todos:
            return ToolResult("the todo list is now empty", metadata={"todos": 0})
        lines = [f"{_MARKS[item['status']]} {item['content']}" for item in box._todos]
        done = sum(item["status"] == "completed" for item in box._todos)
        return ToolResult(f"todo list ({done}/{len(lines)} completed):\n" + "\n".join(lines),
                          metadata={"todos": len(lines), "completed": done})
