"""Text helpers of more than one tool family: output cut to a limit, lines as grep and sed count them."""

from __future__ import annotations


def clip(head: str, limit: int, tail: str = "", missing: int = 0) -> tuple[str, bool]:
    """``head + tail`` cut to about ``limit`` characters: the start and the end are kept, with a note
    in the middle saying how much was cut. ``missing`` characters were already lost between them."""
    keep_front, keep_back = limit // 2, limit - limit // 2
    if not missing:
        text = head + tail
        if len(text) <= limit:
            return text, False
        front, back, total = text[:keep_front], text[len(text) - keep_back:], len(text)
    else:
        front, back = head[:keep_front], tail[max(len(tail) - keep_back, 0):]
        total = len(head) + len(tail) + missing
    cut = total - len(front) - len(back)
    note = (f"\n\n[... {cut} of {total} characters cut here (the limit is {limit}); send long output to a "
            "file and use read or grep on it ...]\n\n")
    return front + note + back, True


def split_lines(text: str) -> list[str]:
    """Lines split at '\n' only, numbered as grep -n and sed count them."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]
