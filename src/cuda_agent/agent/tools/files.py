"""The file tools (read, write, edit, multi_edit) and the confined I/O every tool on files goes through.

The file tools run in this (trusted) process, so they are where the workspace
is enforced: every path must resolve, symbolic links included, to a place
inside the workspace, and files are opened one directory at a time with
``O_NOFOLLOW`` so a link swapped in between the check and the open (by a
background job, say) makes the call fail instead of escaping. Protected paths
may be read but not changed, here and, through read-only binds of the bwrap
sandbox, in the shell.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from cuda_agent.agent.tools.registry import Tool, ToolError, ToolResult, object_schema, register
from cuda_agent.agent.tools.text import split_lines

if TYPE_CHECKING:
    from cuda_agent.agent.tools.toolbox import Toolbox

READ_MAX_LINES = 2000
READ_MAX_LINE_CHARS = 2000
MAX_FILE_BYTES = 64 * 1024 * 1024  # read, edit and grep refuse bigger files (use bash)


class ConfinedFiles:
    """The workspace's files as the tools see them: paths resolved inside ``root``, protected entries
    read-only, files opened without following links. A base of ``Toolbox``."""

    def __init__(self, workspace: Path, protected: Iterable[str]):
        self.root = Path(os.path.realpath(workspace))
        if not self.root.is_dir():
            raise FileNotFoundError(f"workspace {workspace} is not a directory")
        self.protected = tuple(self._protected_entry(p) for p in protected)

    def _protected_entry(self, entry: str) -> str:
        path = PurePosixPath(entry)
        if path.is_absolute():
            try:
                path = PurePosixPath(os.path.relpath(entry, self.root))
            except ValueError:
                pass
        if path.is_absolute() or ".." in path.parts or str(path) in ("", "."):
            raise ValueError(f"protected path {entry!r} must be a path inside the workspace {self.root}")
        return str(path)

    def _read_only(self) -> list[Path]:
        # Only what exists can be bound; a missing protected path is still refused by the file tools.
        return [self.root / entry for entry in self.protected if os.path.lexists(self.root / entry)]

    def _resolve(self, path: str) -> str:
        """The workspace-relative POSIX path that ``path`` denotes ('' for the workspace itself)."""
        if not path.strip():
            raise ToolError("the path is empty; give a path relative to the workspace")
        if "\0" in path:
            raise ToolError(f"the path {path!r} contains a NUL character")
        candidate = path if os.path.isabs(path) else os.path.join(self.root, path)
        real = os.path.realpath(candidate)
        if not self._inside(real):
            via = " through a symbolic link" if self._inside(os.path.normpath(candidate)) else ""
            raise ToolError(f"{path} resolves{via} to {real}, outside the workspace {self.root}; "
                            "only paths inside the workspace can be used")
        rel = os.path.relpath(real, self.root)
        return "" if rel == "." else PurePosixPath(rel).as_posix()

    def _inside(self, path: str) -> bool:
        root = str(self.root)
        return path == root or path.startswith(root.rstrip("/") + "/")

    def _check_writable(self, path: str, rel: str) -> None:
        for entry in self.protected:
            if rel == entry or rel.startswith(entry + "/"):
                what = "it" if rel == entry else f"everything under {entry}/"
                raise ToolError(f"{path} is protected (read-only): {what} may be read but not changed "
                                f"(protected: {', '.join(self.protected)}); {path} is unchanged")
        if rel == "":
            raise ToolError(f"{path} is the workspace directory itself, not a file")

    def _open(self, rel: str, flags: int, *, make_parents: bool = False) -> int:
        """Open ``rel`` one component at a time, never following a symbolic link, so nothing swapped in
        after ``_resolve`` can lead outside the workspace."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        parts = rel.split("/") if rel else []
        part = ""
        try:
            for part in parts[:-1]:
                if make_parents:
                    try:
                        os.mkdir(part, dir_fd=fd)
                    except FileExistsError:
                        pass
                inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                os.close(fd)
                fd = inner
            if not parts:
                return os.dup(fd)
            part = parts[-1]
            # O_NONBLOCK: opening a FIFO the agent made must not hang this process.
            return os.open(part, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o644, dir_fd=fd)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            try:
                link = stat.S_ISLNK(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode)
            except OSError:
                link = False
            if link:  # _resolve saw no link here: one was swapped in since
                raise ToolError(f"{rel}: a symbolic link appeared on the path while it was being used") from None
            raise ToolError(f"{rel}: {part} is a file, not a directory") from None
        finally:
            os.close(fd)

    def _read_bytes(self, path: str, rel: str) -> bytes:
        try:
            fd = self._open(rel, os.O_RDONLY)
        except FileNotFoundError:
            raise ToolError(f"{path} does not exist (in the workspace {self.root}); use glob to find files") from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            what = "a directory; use glob to list it" if stat.S_ISDIR(info.st_mode) else "not a regular file"
            raise ToolError(f"{path} is {what}")
        with os.fdopen(fd, "rb") as handle:
            if info.st_size > MAX_FILE_BYTES:
                raise ToolError(f"{path} has {info.st_size} bytes, more than this tool handles ({MAX_FILE_BYTES}); "
                                "use bash (head, sed -n, grep) on it")
            return handle.read(MAX_FILE_BYTES + 1)

    def _write_bytes(self, path: str, rel: str, data: bytes, *, create: bool) -> None:
        flags = os.O_WRONLY | os.O_TRUNC | (os.O_CREAT if create else 0)
        try:
            fd = self._open(rel, flags, make_parents=create)
        except IsADirectoryError:
            raise ToolError(f"{path} is a directory") from None
        with os.fdopen(fd, "wb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                raise ToolError(f"{path} is not a regular file")
            handle.write(data)

    def _load_text(self, path: str) -> tuple[str, str]:
        """(workspace-relative path, text) of a file that may be changed."""
        rel = self._resolve(path)
        self._check_writable(path, rel)
        # surrogateescape: bytes that are not UTF-8 are written back exactly as they were.
        return rel, self._read_bytes(path, rel).decode("utf-8", errors="surrogateescape")


# ----------------------------------------------------------------------------- the tools

PATH = {"type": "string", "description": "A path relative to the workspace (or absolute, inside it)."}
EDIT = object_schema({
    "old_string": {"type": "string", "description": "The exact text to replace, whitespace included."},
    "new_string": {"type": "string", "description": "The text to put in its place."},
    "replace_all": {"type": "boolean", "description": "Replace every occurrence (default false: "
                                                      "old_string must occur exactly once)."},
}, ["old_string", "new_string"])


@register("read")
class Read(Tool):
    description = (f"Read a text file with numbered lines (like cat -n), at most {READ_MAX_LINES} lines per call; "
                   f"use offset and limit to read further. Lines longer than {READ_MAX_LINE_CHARS} characters are "
                   "cut.")
    parameters = object_schema({
        "path": PATH,
        "offset": {"type": "integer", "description": "The first line to show, counting from 1 (default 1)."},
        "limit": {"type": "integer", "description": f"How many lines to show (default {READ_MAX_LINES})."},
    }, ["path"])

    def call(self, box: Toolbox, path: str, offset: int = 1, limit: int = READ_MAX_LINES) -> ToolResult:
        if offset < 1:
            raise ToolError(f"read: offset counts lines from 1, so it must be at least 1, not {offset}")
        if limit < 1:
            raise ToolError(f"read: limit must be at least 1, not {limit}")
        limit = min(limit, READ_MAX_LINES)
        rel = box._resolve(path)
        data = box._read_bytes(path, rel)
        if b"\0" in data[:8192]:
            raise ToolError(f"{path} looks binary ({len(data)} bytes); inspect it with bash (xxd, python)")
        lines = split_lines(data.decode(errors="replace"))
        if not lines:
            return ToolResult(f"({path} is empty)", metadata={"lines": 0})
        if offset > len(lines):
            raise ToolError(f"read: {path} has {len(lines)} lines, so offset {offset} is past the end")
        out, size, last = [], 0, offset - 1
        for number in range(offset, min(offset + limit, len(lines) + 1)):
            line = lines[number - 1]
            if len(line) > READ_MAX_LINE_CHARS:
                line = line[:READ_MAX_LINE_CHARS] + f" [... line cut at {READ_MAX_LINE_CHARS} characters]"
            entry = f"{number:6}\t{line}"
            if out and size + len(entry) + 1 > box.max_output_chars:
                break
            out.append(entry)
            size += len(entry) + 1
            last = number
        text = "\n".join(out)
        if last < len(lines):
            text += (f"\n[lines {offset}-{last} of {len(lines)}; to read on, call read with offset={last + 1}]")
        return ToolResult(text, metadata={"lines": len(lines), "first": offset, "last": last,
                                          "truncated": last < len(lines)})


@register("write")
class Write(Tool):
    description = ("Write a file, replacing it if it exists; missing parent directories are created. Protected "
                   "files cannot be written.")
    parameters = object_schema({"path": PATH, "content": {"type": "string", "description": "The whole new content."}},
                               ["path", "content"])

    def call(self, box: Toolbox, path: str, content: str) -> ToolResult:
        rel = box._resolve(path)
        box._check_writable(path, rel)
        data = content.encode("utf-8", errors="surrogateescape")
        existed = os.path.lexists(box.root / rel)
        box._write_bytes(path, rel, data, create=True)
        lines = content.count("\n") + (1 if content and not content.endswith("\n") else 0)
        verb = "overwrote" if existed else "created"
        return ToolResult(f"{verb} {rel} ({lines} lines, {len(data)} bytes)", metadata={"path": rel})


def replace(text: str, path: str, old: str, new: str, replace_all: bool) -> tuple[str, int, int]:
    """(new text, occurrences replaced, index of the first one)."""
    if old == "":
        raise ToolError("old_string is empty; to create or replace a whole file use write")
    if old == new:
        raise ToolError("old_string and new_string are the same; nothing would change")
    count = text.count(old)
    if count == 0:
        raise ToolError(f"old_string was not found in {path}; read the file and copy the text exactly, "
                        "whitespace and indentation included")
    first = text.index(old)
    if count > 1 and not replace_all:
        starts, at = [], first
        while at != -1 and len(starts) < 10:
            starts.append(text.count("\n", 0, at) + 1)
            at = text.find(old, at + len(old))
        raise ToolError(f"old_string occurs {count} times in {path} (at lines {', '.join(map(str, starts))}); "
                        "include more surrounding lines to make it unique, or set replace_all=true")
    return text.replace(old, new), count, first


@register("edit")
class Edit(Tool):
    description = ("Replace text in a file: old_string must occur exactly once (add surrounding lines to make it "
                   "unique), unless replace_all is true. Read the file first and copy the text exactly.")
    parameters = object_schema({"path": PATH, **EDIT["properties"]}, ["path", "old_string", "new_string"])

    def call(self, box: Toolbox, path: str, old_string: str, new_string: str,
             replace_all: bool = False) -> ToolResult:
        rel, text = box._load_text(path)
        try:
            updated, count, first = replace(text, path, old_string, new_string, replace_all)
        except ToolError as exc:
            raise ToolError(f"edit: {exc}; {path} is unchanged") from None
        box._write_bytes(path, rel, updated.encode("utf-8", errors="surrogateescape"), create=False)
        start = updated.count("\n", 0, first) + 1
        end = start + new_string.count("\n")
        lines = split_lines(updated)
        shown = range(max(start - 3, 1), min(end + 3, len(lines), start + 30) + 1)
        snippet = "\n".join(f"{n:6}\t{lines[n - 1][:READ_MAX_LINE_CHARS]}" for n in shown)
        plural = "s" if count > 1 else ""
        return ToolResult(f"replaced {count} occurrence{plural} in {rel}; lines {shown.start}-{shown.stop - 1} "
                          f"now read:\n{snippet}", metadata={"path": rel, "replacements": count})


@register("multi_edit")
class MultiEdit(Tool):
    description = ("Several edits of one file, applied in order, each to the result of the one before; if any of "
                   "them fails, none is applied.")
    parameters = object_schema({"path": PATH, "edits": {"type": "array", "items": EDIT, "minItems": 1,
                                                        "description": "The edits, as for the edit tool."}},
                               ["path", "edits"])

    def call(self, box: Toolbox, path: str, edits: list[dict[str, Any]]) -> ToolResult:
        rel, text = box._load_text(path)
        total = 0
        for number, edit in enumerate(edits, 1):
            try:
                text, count, _ = replace(text, path, edit["old_string"], edit["new_string"],
                                         edit.get("replace_all", False))
            except ToolError as exc:
                raise ToolError(f"multi_edit: edit {number} of {len(edits)} failed: {exc} (old_string is matched "
                                f"against the text after the edits before it); no edit was applied, {path} is "
                                "unchanged") from None
            total += count
        box._write_bytes(path, rel, text.encode("utf-8", errors="surrogateescape"), create=False)
        return ToolResult(f"applied {len(edits)} edits to {rel} ({total} replacements)",
                          metadata={"path": rel, "replacements": total})
