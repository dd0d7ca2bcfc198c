"""Markdown pieces the generated pages share: a banner naming the sources, tables whose cells survive any text."""

from __future__ import annotations

import inspect
import json
import re
from typing import Any, Iterable, Sequence

_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)


def banner(title: str, *sources: str) -> str:
    """The page's title and a note that it is generated (edit the sources, not the page)."""
    names = ", ".join(f"`{s}`" for s in sources)
    return (f"# {title}\n\n!!! note \"Generated page\"\n    Generated at build time from {names} by `docs/generate/` "
            "(an MkDocs hook, `docs/hooks.py`): edit the source, not this page.\n")


def prose(text: Any, pipes: bool = False) -> str:
    """Text from the code as Markdown shows it: `<`, `>` (and with `pipes`, `|`) escaped outside code spans, where a
    description's `<pool>` would otherwise be read as an HTML tag."""
    text = str(text or "")
    parts, last = [], 0
    for m in _CODE_SPAN.finditer(text):
        parts += [_escape(text[last:m.start()], pipes), m.group(0)]
        last = m.end()
    return "".join(parts) + _escape(text[last:], pipes)


def docstring(obj: Any) -> str:
    """A class's own docstring (one without does not inherit its base's), or the first paragraph of a module's, as prose."""
    doc = obj.__dict__.get("__doc__") if isinstance(obj, type) else (obj.__doc__ or "").split("\n\n")[0]
    return prose(inspect.cleandoc(doc)) if doc else ""


def cell(text: Any) -> str:
    """`text` as one table cell: one line, escaped as `prose`, pipes too."""
    return prose(" ".join(str(text or "").split()), pipes=True)


def _escape(text: str, pipes: bool) -> str:
    text = text.replace("<", "&lt;").replace(">", "&gt;")
    return text.replace("|", "\\|") if pipes else text


def code(text: Any) -> str:
    """`text` as a code span (empty stays empty); backticks inside get a longer fence."""
    text = str(text)
    if not text:
        return ""
    fence = "``" if "`" in text else "`"
    return f"{fence}{text}{fence}" if fence == "`" else f"{fence} {text} {fence}"


def value(v: Any) -> str:
    """A default as YAML/JSON shows it (null, true, "text", {"24h": 86400.0}), as a code span."""
    return code(json.dumps(v, default=str, ensure_ascii=False))


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
