"""Configs in and out: TOML files and section.key=value overrides parsed into a
checked `Config`, and a config written back as TOML (every run directory's config.toml)."""

from __future__ import annotations

import dataclasses
import difflib
import math
import stat
import tomllib
import typing
from pathlib import Path
from typing import Any, Literal

from ctseg import compat
from ctseg.config.checks import LARGEST_INT, check
from ctseg.config.sections import SECTION_TYPES, SECTIONS, Config
from ctseg.errors import CtsegError, OptionError

# Keys of earlier versions, which `compat.config` reads in a run's config.toml, and what
# replaced them: a `--set` of one is a user's mistake (beside a config that sets the new
# key, it would be silently overridden), refused naming its replacement.
LEGACY_KEYS = {
    ("train", "held_norm_steps"): (
        "train.frozen_norm_share, a share of train.steps (e.g. 0.25 freezes the last quarter)"
    ),
    ("train", "held_norm_share"): "train.frozen_norm_share, the same share renamed",
}


def _closest(name: str, allowed: list[str]) -> str:
    match = difflib.get_close_matches(name, allowed, n=1)
    hint = f"; did you mean '{match[0]}'?" if match else ""
    return f"allowed: {', '.join(allowed)}{hint}"


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Check `value` against the annotation `hint`; return it in the field's type."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise CtsegError(f"{key} = {value!r} is not allowed; choose one of {list(choices)}")
        return value
    if origin is tuple:
        args = typing.get_args(hint)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise CtsegError(f"{key} must be a list of {len(args)} values, got {value!r}")
        return tuple(
            _coerce(f"{key}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args, strict=True))
        )
    if hint is bool:
        if not isinstance(value, bool):
            raise CtsegError(f"{key} must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise CtsegError(f"{key} must be an integer, got {value!r}")
        if not -LARGEST_INT - 1 <= value <= LARGEST_INT:
            raise CtsegError(
                f"{key} = {value} is beyond the integers JAX computes with "
                f"(−2^31 … 2^31 − 1 = {LARGEST_INT})"
            )
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CtsegError(f"{key} must be a number, got {value!r}")
        # TOML has nan and inf; no setting means anything with them.
        if not math.isfinite(value):
            raise CtsegError(f"{key} must be a finite number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise CtsegError(f"{key} must be a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config annotation {hint!r} for {key}")  # a bug, not user error


def _build_section(name: str, values: dict[str, Any]) -> Any:
    cls = SECTION_TYPES[name]
    hints = typing.get_type_hints(cls, include_extras=True)
    allowed = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if key not in allowed:
            raise CtsegError(f"unknown config key '{name}.{key}'; {_closest(key, allowed)}")
        kwargs[key] = _coerce(f"{name}.{key}", value, hints[key])
    return cls(**kwargs)


def from_dict(raw: dict[str, Any]) -> Config:
    """Build and validate a Config from nested plain values (as TOML gives them)."""
    sections = {}
    for name, values in compat.config(raw).items():
        if name not in SECTIONS:
            raise CtsegError(f"unknown config section '{name}'; {_closest(name, list(SECTIONS))}")
        if not isinstance(values, dict):
            raise CtsegError(f"config section '{name}' must be a table")
        sections[name] = _build_section(name, values)
    config = Config(**sections)
    check(config)
    return config


def _refuse_legacy_override(section: str, key: str) -> None:
    new = LEGACY_KEYS.get((section, key))
    if new is not None:
        raise OptionError(
            f"`overrides` {section}.{key}: an earlier version's key (read only in old runs' "
            f"config.toml), replaced by {new}"
        )


def _config_file_problem(path: Path) -> str | None:
    """Why `path` cannot be a config file (missing, a folder, a device, a FIFO …), without
    opening it: reading a FIFO would wait for a writer."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return f"config file not found: {path}"
    except OSError as exc:
        return f"cannot read {path}: {exc.strerror or exc}"
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return f"{path} is a folder, not a config file (see configs/)"
    kinds = (
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    what = next((words for test, words in kinds if test(mode)), "not a file")
    return f"{path} is {what}, not a regular file: give a TOML config file (see configs/)"


def to_dict(config: Config) -> dict[str, dict[str, Any]]:
    return {
        section: {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
        for section, values in dataclasses.asdict(config).items()
    }


def with_mesh(
    config: Config,
    spatial: typing.Sequence[int] | None = None,
    data: int | None = None,
    partitioner: str | None = None,
) -> Config:
    """`config` with another layout (the arguments given), checked as a config file is."""
    raw = to_dict(config)
    changes = {"spatial": None if spatial is None else list(spatial), "data": data}
    changes["partitioner"] = partitioner
    raw["mesh"].update({key: value for key, value in changes.items() if value is not None})
    return from_dict(raw)


def _parse_override(item: str) -> tuple[str, str, Any]:
    if "=" not in item:
        raise OptionError(f"`overrides` expects section.key=value, got '{item}'")
    dotted, text = item.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) != 2:
        raise OptionError(f"`overrides` expects section.key=value, got '{item}'")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare word such as `gspmd` is a string
    return parts[0], parts[1], value


def load(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Load a TOML config (or the defaults) and apply `overrides` (section.key=value)."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        problem = _config_file_problem(path)
        if problem is not None:
            raise CtsegError(problem)
        try:
            # TOML is UTF-8 whatever the locale (GDCM's writer, for one, can set it to C).
            raw = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            raise CtsegError(f"{path} is not valid TOML: {exc}") from None
        except UnicodeDecodeError as exc:
            raise CtsegError(
                f"{path} is not a TOML file: byte {exc.start} is not UTF-8 text"
            ) from None
        except OSError as exc:
            raise CtsegError(f"cannot read {path}: {exc.strerror or exc}") from None
    for item in overrides:
        section, key, value = _parse_override(item)
        if section not in SECTIONS:
            raise CtsegError(
                f"unknown config section '{section}'; {_closest(section, list(SECTIONS))}"
            )
        _refuse_legacy_override(section, key)
        raw.setdefault(section, {})[key] = value
    return from_dict(raw)


def to_toml(config: Config) -> str:
    """The fully resolved config as TOML text (written into every run directory)."""
    lines = []
    for section, values in to_dict(config).items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            lines.append(f"{key} = {toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return repr(value)
