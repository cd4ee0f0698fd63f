"""The search tools: glob (paths) and grep (contents), over the workspace, never following links out of it."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import PurePosixPath
from typing import TYPE_CHECKING

from cuda_agent.agent.tools.registry import Tool, ToolError, ToolResult, object_schema, register
from cuda_agent.agent.tools.text import clip, split_lines

if TYPE_CHECKING:
    from cuda_agent.agent.tools.toolbox import Toolbox

GLOB_MAX_RESULTS = 500
GREP_MAX_MATCHES = 250
GREP_MAX_LINE_CHARS = 500
MAX_CONTEXT_LINES = 20


def glob_regex(pattern: str) -> re.Pattern[str]:
    """A glob as a regular expression over '/'-separated relative paths."""
    return re.compile(_glob_part(pattern) + r"\Z", re.DOTALL)


def _glob_part(pattern: str) -> str:
    out, i = [], 0
    while i < len(pattern):
        char = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif char == "*":
            out.append("[^/]*")
            i += 1
        elif char == "?":
            out.append("[^/]")
            i += 1
        elif char == "[" and pattern.find("]", i + 2) != -1:
            end = pattern.find("]", i + 2)  # from i + 2: a ']' right after '[' is part of the set
            body = pattern[i + 1:end].replace("\\", "\\\\").replace("[", "\\[")
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
            i = end + 1
        elif char == "{":
            depth, end = 0, None
            for j in range(i, len(pattern)):
                depth += {"{": 1, "}": -1}.get(pattern[j], 0)
                if depth == 0:
                    end = j
                    break
            if end is None:
                out.append(re.escape(char))
                i += 1
                continue
            options, depth, start = [], 0, i + 1
            for j in range(i + 1, end):
                depth += {"{": 1, "}": -1}.get(pattern[j], 0)
                if pattern[j] == "," and depth == 0:
                    options.append(pattern[start:j])
                    start = j + 1
            options.append(pattern[start:end])
            out.append("(?:" + "|".join(_glob_part(option) for option in options) + ")")
            i = end + 1
        else:
            out.append(re.escape(char))
            i += 1
    return "".join(out)


def walk(box: Toolbox, rel: str) -> Iterator[tuple[str, bool]]:
    """(workspace-relative path, is_dir) under the directory ``rel``, sorted, without following links."""
    top = box.root / rel if rel else box.root
    for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
        dirnames.sort()
        base = os.path.relpath(dirpath, box.root)
        base = "" if base == "." else PurePosixPath(base).as_posix() + "/"
        for name in dirnames:
            yield base + name, not os.path.islink(os.path.join(dirpath, name))
        for name in sorted(filenames):
            yield base + name, False


def search_root(box: Toolbox, path: str | None) -> str:
    """The workspace-relative directory or file to search ('' for the whole workspace)."""
    if path is None:
        return ""
    rel = box._resolve(path)
    if not os.path.exists(box.root / rel):
        raise ToolError(f"{path} does not exist (in the workspace {box.root})")
    return rel


@register("glob")
class Glob(Tool):
    description = ("List files and directories whose path matches a glob pattern (* and ? within a name, ** "
                   "across directories, [abc], {a,b}), relative to the workspace, sorted. Directories end with /.")
    parameters = object_schema({
        "pattern": {"type": "string", "description": "e.g. 'kernels/*.cu' or '**/*.py'."},
        "path": {"type": "string", "description": "The directory to search in (default: the workspace); "
                                                  "the pattern is matched relative to it."},
    }, ["pattern"])

    def call(self, box: Toolbox, pattern: str, path: str | None = None) -> ToolResult:
        if not pattern.strip():
            raise ToolError("glob: the pattern is empty; try '**/*' for everything")
        rel = search_root(box, path)
        if not os.path.isdir(box.root / rel):
            raise ToolError(f"glob: {path} is not a directory")
        if os.path.isabs(pattern):
            pattern = os.path.relpath(pattern, box.root / rel)
        if ".." in PurePosixPath(pattern).parts:
            raise ToolError("glob: the pattern may not contain '..'; set path to search another directory "
                            "inside the workspace")
        while pattern.startswith("./"):
            pattern = pattern[2:]
        regex = glob_regex(pattern)
        prefix = rel + "/" if rel else ""
        matches = []
        for entry, is_dir in walk(box, rel):
            if regex.match(entry[len(prefix):]):
                matches.append(entry + "/" if is_dir else entry)
        matches.sort()
        if not matches:
            return ToolResult(f"no files match {pattern!r} in {rel or 'the workspace'}", metadata={"count": 0})
        text = "\n".join(matches[:GLOB_MAX_RESULTS])
        if len(matches) > GLOB_MAX_RESULTS:
            text += f"\n[{len(matches) - GLOB_MAX_RESULTS} more matches not shown; use a narrower pattern or path]"
        clipped, truncated = clip(text, box.max_output_chars)
        return ToolResult(clipped, metadata={"count": len(matches),
                                             "truncated": truncated or len(matches) > GLOB_MAX_RESULTS})


@register("grep")
class Grep(Tool):
    description = ("Search file contents with a Python regular expression; prints file:line: text for each "
                   f"matching line (at most {GREP_MAX_MATCHES}).")
    parameters = object_schema({
        "pattern": {"type": "string", "description": "A Python regular expression, matched per line."},
        "path": {"type": "string", "description": "A file or directory to search (default: the workspace)."},
        "glob": {"type": "string", "description": "Only files matching this glob, e.g. '*.cu' (a pattern "
                                                  "without / is matched against the file name)."},
        "ignore_case": {"type": "boolean", "description": "Match case-insensitively (default false)."},
        "context": {"type": "integer", "description": f"Lines of context around each match (0 to "
                                                     f"{MAX_CONTEXT_LINES}, default 0)."},
    }, ["pattern"])

    def call(self, box: Toolbox, pattern: str, path: str | None = None, glob: str | None = None,
             ignore_case: bool = False, context: int = 0) -> ToolResult:
        try:
            regex = re.compile(pattern, re.IGNORECASE if ignore_case else 0)
        except re.error as exc:
            raise ToolError(f"grep: {pattern!r} is not a valid Python regular expression: {exc}") from None
        if not 0 <= context <= MAX_CONTEXT_LINES:
            raise ToolError(f"grep: context must be between 0 and {MAX_CONTEXT_LINES}, not {context}")
        rel = search_root(box, path)
        name_filter = glob_regex(glob) if glob else None
        if os.path.isdir(box.root / rel):
            prefix = rel + "/" if rel else ""
            files = sorted(entry for entry, is_dir in walk(box, rel) if not is_dir)
        else:
            prefix, files = "", [rel]
        out: list[str] = []
        matched = files_with = 0
        for file in files:
            if name_filter and not name_filter.match(file[len(prefix):] if "/" in glob else file.rsplit("/", 1)[-1]):
                continue
            if os.path.islink(box.root / file) and not box._inside(os.path.realpath(box.root / file)):
                continue  # a link out of the workspace: its target is none of the agent's business
            try:
                data = box._read_bytes(file, box._resolve(file))
            except (ToolError, OSError):  # vanished, unreadable, too big, a FIFO: not searchable
                continue
            if b"\0" in data[:8192]:
                continue
            lines = split_lines(data.decode(errors="replace"))
            hits = [n for n, line in enumerate(lines) if regex.search(line)]
            hit_set = set(hits)
            if not hits:
                continue
            files_with += 1
            shown_until = -1
            for n in hits:
                if matched >= GREP_MAX_MATCHES:
                    break
                matched += 1
                lo, hi = max(n - context, shown_until + 1), min(n + context, len(lines) - 1)
                if context and out and (shown_until < 0 or lo > shown_until + 1):
                    out.append("--")  # as grep does between groups that are not adjacent
                for k in range(lo, hi + 1):
                    line = lines[k]
                    if len(line) > GREP_MAX_LINE_CHARS:
                        line = line[:GREP_MAX_LINE_CHARS] + " [...]"
                    out.append(f"{file}:{k + 1}: {line}" if k in hit_set else f"{file}-{k + 1}- {line}")
                shown_until = max(shown_until, hi)
            if matched >= GREP_MAX_MATCHES:
                out.append(f"[stopped at {GREP_MAX_MATCHES} matching lines; narrow the pattern, path or glob]")
                break
        if not out:
            return ToolResult(f"no matches for {pattern!r} in {rel or 'the workspace'}", metadata={"matches": 0})
        text, truncated = clip("\n".join(out), box.max_output_chars)
        return ToolResult(text, metadata={"matches": matched, "files": files_with, "truncated": truncated})
