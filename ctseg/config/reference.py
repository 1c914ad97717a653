"""The configuration reference table (docs/reference/configuration.md), generated from the
sections' field docs; a test keeps the page in sync."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal

from ctseg.config.parse import to_dict, toml_value
from ctseg.config.sections import SECTION_TYPES, Config


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return " \\| ".join(f'"{c}"' for c in typing.get_args(hint))
    if origin is tuple:
        return "[" + ", ".join(_type_name(a) for a in typing.get_args(hint)) + "]"
    if isinstance(hint, types.GenericAlias):
        return str(hint)
    return hint.__name__


def reference_markdown() -> str:
    """The configuration reference table, as docs/reference/configuration.md shows it."""
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    defaults = to_dict(Config())
    for section, cls in SECTION_TYPES.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = toml_value(defaults[section][f.name])
            rows.append(
                f"| `{section}.{f.name}` | {_type_name(hints[f.name])} | `{default}` | "
                f"{f.metadata['doc']} |"
            )
    return "\n".join(rows)
