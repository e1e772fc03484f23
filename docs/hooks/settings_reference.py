"""MkDocs hook: the configuration reference, generated from ``gateway.config.Settings``.

``docs/operators/configuration.md`` holds a marker; at build time it becomes a table of every
setting: its environment variable, type, default and description, read from the settings
object itself, so the page cannot drift from the code. A setting without a description fails
the build (and ``tests/deployment/test_docs.py``).
"""

from __future__ import annotations

import enum
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import SecretStr
from pydantic.fields import FieldInfo

#: The table replaces everything from the marker to its end marker (a note for readers of the
#: Markdown source).
MARKER = "<!-- settings-table -->"
END_MARKER = "<!-- /settings-table -->"


class UndocumentedSetting(Exception):
    """A field of the settings object has no description."""


def _type(field: FieldInfo) -> str:
    annotation = field.annotation
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Literal:
        return " | ".join(f"`{a}`" for a in typing.get_args(annotation))
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        if len(args) == 1:
            annotation = args[0]
            if typing.get_origin(annotation) is typing.Literal:
                return " | ".join(f"`{a}`" for a in typing.get_args(annotation))
    names: dict[Any, str] = {bool: "boolean", int: "integer", float: "number", str: "text",
                             Path: "path", SecretStr: "secret"}
    kind: str = names.get(annotation) or getattr(annotation, "__name__", None) or str(annotation)
    bounds = []
    for meta in field.metadata:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(meta, attr, None) is not None:
                bounds.append(f"{sign} {getattr(meta, attr)}")
    return kind + (f" ({', '.join(bounds)})" if bounds else "")


def _default(field: FieldInfo) -> str:
    value: Any = field.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, Path):
        # The default cache directory is under the home of whoever builds the docs.
        try:
            value = "~/" + str(value.relative_to(Path.home()))
        except ValueError:
            value = str(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"`{value}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def rows() -> list[tuple[str, str, str, str]]:
    """(variable, type, default, description) of every setting, in declaration order."""
    from gateway.config import Settings

    prefix = Settings.model_config.get("env_prefix", "")
    out = []
    for name, field in Settings.model_fields.items():
        if field.description is None or not field.description.strip():
            raise UndocumentedSetting(
                f"gateway/config.py: the setting {name!r} has no description; the "
                "configuration reference is generated from the descriptions")
        out.append((f"{prefix}{name}".upper(), _type(field), _default(field), field.description))
    return out


def settings_table() -> str:
    """The Markdown table the marker becomes."""
    lines = ["| Variable | Type | Default | Meaning |", "|---|---|---|---|"]
    for variable, kind, default, description in rows():
        lines.append(f"| `{variable}` | {_cell(kind)} | {_cell(default)} | "
                     f"{_cell(description)} |")
    return "\n".join(lines) + "\n"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """MkDocs event: put the generated table where the marker is."""
    if MARKER not in markdown:
        return markdown
    before, rest = markdown.split(MARKER, 1)
    _, after = rest.split(END_MARKER, 1) if END_MARKER in rest else ("", rest)
    return before + settings_table() + after
