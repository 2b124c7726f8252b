"""One printable column per character: what every text sink (the views, the text log) does to a
text a process chose (its command line, name, user, cgroup, job id, buffer names) before it
reaches a terminal. JSON sinks keep the text exact."""

from __future__ import annotations

import unicodedata

__all__ = ["clean"]


def clean(text: str) -> str:
    """`text` with what is not one printable column each as `?`, as ps and top show it. A command
    line is the process's to choose: an escape sequence in it must not reach the terminal (clear
    it, retitle it, paint a forged row), nor a newline or a carriage return start a line of its
    own, nor a zero-width mark, a bidi override or a double-width character break the columns
    (every width here is a count of characters)."""
    if text.isascii() and text.isprintable():
        return text
    return "".join(c if _one_column(c) else "?" for c in text)


def _one_column(c: str) -> bool:
    if c.isascii():
        return c.isprintable()
    return (unicodedata.category(c)[0] not in "CZM"
            and unicodedata.east_asian_width(c) not in ("W", "F"))
