"""Model names are names, not paths: the rule every place a client-given name becomes a path follows.

The repository calls :func:`name_problem` before a load or unload touches the file system, and
:func:`model_directory` to turn a checked name into the model's directory, refusing one that
resolves (through a symbolic link) outside the repository. Config fields that name files inside
a model directory (``default_model_filename``) are checked with :func:`file_name_problem`.
Pure functions apart from ``model_directory``'s ``resolve()``; no protocol knows about them.
"""

from __future__ import annotations

import unicodedata
from pathlib import Path

MAX_MODEL_NAME_BYTES = 255
"""Longest model name in UTF-8 bytes: one file-name component on Linux file systems (NAME_MAX)."""

ALLOWED = (
    f"a model name is 1 to {MAX_MODEL_NAME_BYTES} bytes of UTF-8, not blank, without '/', '\\', '..', "
    "control characters or a leading '.'"
)


def shown(name: str, limit: int = 64) -> str:
    """``name`` as it may appear in a message or a log line: control characters escaped, cut at
    ``limit`` characters (a hostile name must not forge log lines or flood them)."""
    escaped = "".join(
        c if unicodedata.category(c)[0] != "C" else c.encode("unicode_escape").decode("ascii") for c in name[:limit]
    )
    return escaped + ("..." if len(name) > limit else "")


def name_problem(name: str) -> str | None:
    """What is wrong with ``name`` as a model name, or None when it is a valid one."""
    if not name:
        return "the name is empty"
    if not name.strip():
        return "the name is blank"
    if any(unicodedata.category(c)[0] == "C" for c in name):
        return "the name contains control or unassigned characters"
    if "/" in name or "\\" in name:
        return "the name contains a path separator"
    if ".." in name:
        return "the name contains '..'"
    if name.startswith("."):
        return "the name starts with '.'"
    if len(name.encode("utf-8", "surrogatepass")) > MAX_MODEL_NAME_BYTES:
        return f"the name is {len(name.encode('utf-8', 'surrogatepass'))} bytes long"
    return None


def file_name_problem(value: str) -> str | None:
    """What is wrong with ``value`` as the name of a file inside a model's version directory."""
    if not value.strip():
        return "it is blank"
    if "/" in value or "\\" in value or value in (".", "..") or any(unicodedata.category(c)[0] == "C" for c in value):
        return "it must be a file name in the version directory, not a path"
    return None


def model_directory(root: Path, name: str) -> Path | None:
    """The directory of model ``name`` (already checked with :func:`name_problem`) in the repository
    ``root``; None when it resolves outside the repository (a symbolic link pointing elsewhere:
    Sluice serves only what lies inside the repository it was given)."""
    path = root / name
    resolved_root = root.resolve()
    resolved = path.resolve()
    if resolved == resolved_root or not resolved.is_relative_to(resolved_root):
        return None
    return path


def version_number(name: str) -> int | None:
    """The version a model's subdirectory named ``name`` holds, or None when it is not a version
    directory: Triton takes only names of ASCII digits that do not start with 0 ("01" and "0" are
    ignored, as are digits of other scripts, which ``str.isdigit`` would accept)."""
    if not name.isascii() or not name.isdigit() or name.startswith("0"):
        return None
    return int(name)
