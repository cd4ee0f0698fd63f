"""Compiler output (g++, nvcc, ptxas, ld) -> structured, de-duplicated diagnostics."""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass
from typing import Any

MAX_DIAGNOSTICS = 30
MAX_MESSAGE = 400

_GCC = re.compile(
    r"^(?P<file>[^:\n]+):(?P<line>\d+):(?:(?P<col>\d+):)?\s*"
    r"(?P<sev>fatal error|error|warning|note):\s*(?P<msg>.*)$"
)
_NVCC = re.compile(
    r"^(?P<file>[^\n(]+)\((?P<line>\d+)\):\s*(?P<sev>catastrophic error|error|warning|remark)"
    r"(?:\s*#[\w-]+)?:\s*(?P<msg>.*)$"
)
_TOOL = re.compile(r"^(?:\S*/)?(?P<tool>ptxas|nvlink|nvcc|ld|collect2)\s*:?\s*(?P<sev>fatal|error|warning)\s*:\s*(?P<msg>.*)$")
_UNDEFINED = re.compile(r"undefined (reference|symbol)", re.IGNORECASE)
_SEVERITY_ORDER = {"error": 0, "warning": 1, "note": 2}


@dataclass(frozen=True)
class Diagnostic:
    severity: str  # error | warning | note
    message: str
    file: str | None = None
    line: int | None = None
    column: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        where = self.file or "<build>"
        if self.line is not None:
            where += f":{self.line}"
            if self.column is not None:
                where += f":{self.column}"
        return f"{where}: {self.severity}: {self.message}"


def _severity(raw: str) -> str:
    raw = raw.lower()
    if "error" in raw or raw == "fatal":
        return "error"
    if raw in ("warning",):
        return "warning"
    return "note"


def parse_diagnostics(output: str, source_root: str | None = None) -> list[Diagnostic]:
    """Parse compiler output; paths under ``source_root`` become relative to it."""
    found: list[Diagnostic] = []
    nvcc_pending: Diagnostic | None = None
    for raw_line in output.splitlines():
        line = raw_line.rstrip()
        if not line:
            continue
        match = _GCC.match(line) or _NVCC.match(line)
        if match:
            groups = match.groupdict()
            nvcc_pending = None
            diag = Diagnostic(
                severity=_severity(groups["sev"]),
                message=groups["msg"].strip(),
                file=_relative(groups["file"].strip(), source_root),
                line=int(groups["line"]),
                column=int(groups["col"]) if groups.get("col") else None,
            )
            found.append(diag)
            if _NVCC.match(line) and not diag.message:
                nvcc_pending = diag
            continue
        if nvcc_pending is not None and raw_line.startswith(" "):
            # nvcc's EDG front end may put the message on the next, indented line.
            found[-1] = Diagnostic(**{**nvcc_pending.to_dict(), "message": line.strip()})
            nvcc_pending = None
            continue
        if _UNDEFINED.search(line):
            found.append(Diagnostic(severity="error", message=_strip_paths(line, source_root)))
            continue
        tool = _TOOL.match(line)
        if tool and tool.group("sev"):
            found.append(Diagnostic(severity=_severity(tool.group("sev")), message=f"{tool.group('tool')}: {tool.group('msg').strip()}"))
    return summarize(found)


def summarize(diagnostics: list[Diagnostic]) -> list[Diagnostic]:
    """De-duplicate, put errors first, cap the count and the message length."""
    seen: set[tuple] = set()
    unique: list[Diagnostic] = []
    for diag in diagnostics:
        message = diag.message if len(diag.message) <= MAX_MESSAGE else diag.message[: MAX_MESSAGE - 3] + "..."
        diag = Diagnostic(diag.severity, message, diag.file, diag.line, diag.column)
        key = (diag.severity, diag.message, diag.file, diag.line)
        if key in seen:
            continue
        seen.add(key)
        unique.append(diag)
    unique.sort(key=lambda d: _SEVERITY_ORDER.get(d.severity, 3))
    return unique[:MAX_DIAGNOSTICS]


def _relative(path: str, root: str | None) -> str:
    if root and path.startswith(root):
        return os.path.normpath(path[len(root) :].lstrip("/"))
    return path


def _strip_paths(text: str, root: str | None) -> str:
    return text.replace(root.rstrip("/") + "/", "") if root else text
