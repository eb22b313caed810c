"""What a repository poll found, and what changed since the last one: plain data and pure functions.

``watcher.scan`` reads a model repository into a :data:`Snapshot` (config bytes and, per file, its
size and mtime); :func:`changes` compares two of them. The watcher loads the models it returns as
added or changed and unloads the removed ones. No I/O here, so every case is a table test.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Collection, Mapping

FileStamp = tuple[str, int, int]
"""(path relative to its directory, size in bytes, mtime in ns): what tells a file changed."""


@dataclasses.dataclass(frozen=True)
class ModelFiles:
    """One model directory as a poll saw it."""

    config: bytes | None
    """The config file's content (``config.pbtxt`` or its YAML/JSON form); ``None``: no config file."""
    files: frozenset[FileStamp] = frozenset()
    """Files of the model directory outside its version directories and other than the config (label files)."""
    versions: Mapping[int, frozenset[FileStamp]] = dataclasses.field(default_factory=dict)
    """Version number -> the files under that version directory, recursively."""


Snapshot = Mapping[str, ModelFiles]
"""Model name -> its files."""


class Kind(enum.Enum):
    ADDED = "added"
    REMOVED = "removed"
    CHANGED = "changed"


@dataclasses.dataclass(frozen=True)
class Change:
    kind: Kind
    versions_added: tuple[int, ...] = ()
    versions_removed: tuple[int, ...] = ()
    versions_changed: tuple[int, ...] = ()
    config_changed: bool = False
    files_changed: bool = False

    def describe(self) -> str:
        """One phrase for the log: ``versions added [3]; config changed``."""
        if self.kind is not Kind.CHANGED:
            return self.kind.value
        parts = [
            f"versions {what} {list(versions)}"
            for what, versions in (
                ("added", self.versions_added),
                ("removed", self.versions_removed),
                ("changed", self.versions_changed),
            )
            if versions
        ]
        if self.config_changed:
            parts.append("config changed")
        if self.files_changed:
            parts.append("model files changed")
        return "; ".join(parts)


def model_change(old: ModelFiles | None, new: ModelFiles | None) -> Change | None:
    """How one model changed between two polls; ``None`` when it did not."""
    if old is None and new is None:
        return None
    if old is None:
        return Change(Kind.ADDED)
    if new is None:
        return Change(Kind.REMOVED)
    added = tuple(sorted(set(new.versions) - set(old.versions)))
    removed = tuple(sorted(set(old.versions) - set(new.versions)))
    changed = tuple(sorted(v for v in set(old.versions) & set(new.versions) if old.versions[v] != new.versions[v]))
    config_changed = old.config != new.config
    files_changed = old.files != new.files
    if not (added or removed or changed or config_changed or files_changed):
        return None
    return Change(Kind.CHANGED, added, removed, changed, config_changed, files_changed)


def changes(old: Snapshot, new: Snapshot) -> dict[str, Change]:
    """Every model that was added, removed or changed between ``old`` and ``new``, by name (sorted)."""
    out = {}
    for name in sorted(set(old) | set(new)):
        change = model_change(old.get(name), new.get(name))
        if change is not None:
            out[name] = change
    return out


def ensembles_to_retry(
    found: Mapping[str, Change], failed: Collection[str], steps_of: Mapping[str, Collection[str]]
) -> list[str]:
    """The failed models a poll loads again, by name (sorted): those whose config names a local step
    model the poll found added. An ensemble is refused while a step model is not in the repository;
    Triton loads it once the step appears, and so does Sluice. ``failed``: models whose last load failed
    (nothing serving, or older versions serving on); ``steps_of``: the local step models each one's
    config on disk names (none for a model that is not an ensemble). A model the poll itself loads
    or unloads is not retried."""
    added = {name for name, change in found.items() if change.kind is Kind.ADDED}
    return sorted(name for name in failed if name not in found and added.intersection(steps_of.get(name, ())))


@dataclasses.dataclass
class PollCounts:
    """Repository polls since start, for the metrics (``sluice_repository_poll*``)."""

    polls: int = 0
    failures: int = 0
    """Polls that could not read the repository (a cloud store unreachable): nothing changed."""
    last_error: str = ""
