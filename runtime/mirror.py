"""A cloud model repository (``--model-repository s3://bucket/prefix``, ``gs://``, ``az://``) kept as a
local mirror the repository loads from.

:meth:`RepositoryMirror.sync` lists ``<prefix>/<model>/...`` through the puller's fsspec stores (the
same filesystem construction, credential chains, retries and error classes as ``sluice pull``) and
brings the local cache up to date, fetching only what changed (listed size and ETag/generation):

* a version directory is downloaded whole into ``.sluice-store/<model>/<version>-<tag>`` (the tag
  digests the version's listing) and then made current by atomically replacing the symbolic link
  ``<model>/<version>`` with one to it. A served version's files are never rewritten or removed under
  it: :meth:`collect` removes store directories no link points at, and only for models the caller
  says no longer serve an older copy;
* the files of a model directory outside its versions (the config, label files) are replaced
  atomically (written beside, renamed over);
* what the store no longer holds (a version, a file, a whole model) is removed from the mirror, so
  the watcher sees the same change as on a local disk.

Blocking: the server runs it on a worker thread. A store that cannot be reached raises
:class:`pull.PullError` with the URL (no credentials) and leaves the mirror as it was.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path

from sluice.runtime import names, pull, puller
from sluice.runtime.puller import RemoteFile

log = logging.getLogger("sluice.runtime.mirror")

STORE = ".sluice-store"
"""Directory of the cache root holding the downloaded version directories (not a model: leading '.')."""
SCHEMES = pull.OBJECT_STORES


@dataclasses.dataclass(frozen=True)
class Layout:
    """A store listing grouped as a model repository (pure: :func:`layout`)."""

    versions: Mapping[tuple[str, int], tuple[RemoteFile, ...]]
    """(model, version) -> the files under ``<model>/<version>/``."""
    files: Mapping[str, RemoteFile]
    """``<model>/<file>`` (outside version directories) -> the object."""
    skipped: tuple[str, ...] = ()
    """Objects that are no part of a model repository (files at the top, invalid model names)."""

    @property
    def models(self) -> set[str]:
        return {model for model, _ in self.versions} | {path.split("/", 1)[0] for path in self.files}


def layout(listing: Collection[RemoteFile]) -> Layout:
    """Group a recursive listing of the repository prefix into models, versions and model files."""
    versions: dict[tuple[str, int], list[RemoteFile]] = {}
    files: dict[str, RemoteFile] = {}
    skipped = []
    for file in sorted(listing, key=lambda f: f.relative):
        parts = file.relative.split("/")
        if len(parts) < 2 or names.name_problem(parts[0]) is not None or parts[0] == STORE:
            skipped.append(file.relative)
            continue
        model = parts[0]
        if len(parts) >= 3 and (version := names.version_number(parts[1])) is not None:
            versions.setdefault((model, version), []).append(file)
        else:
            files[file.relative] = file
    return Layout({key: tuple(group) for key, group in versions.items()}, files, tuple(skipped))


def version_tag(files: Collection[RemoteFile], prefix: str) -> str:
    """A digest of a version directory's listing: it changes when any file is added, removed or changed."""
    lines = sorted(f"{f.relative.removeprefix(prefix)}\t{f.size}\t{f.tag}\n" for f in files)
    return hashlib.sha256("".join(lines).encode()).hexdigest()[:16]


def file_tag(file: RemoteFile) -> str:
    return f"{file.size}:{file.tag}"


def is_remote(url: str) -> bool:
    """Whether ``--model-repository`` names a cloud repository rather than a local directory."""
    scheme, sep, _ = url.partition("://")
    return bool(sep) and scheme.lower() in (*SCHEMES, "https", "http", "gcs", "abfs")


def cache_root(cache_dir: Path, url: str) -> Path:
    """The local mirror of ``url`` under ``cache_dir``: one directory per repository URL."""
    display = pull.redact(url).rstrip("/")
    return cache_dir / hashlib.sha256(display.encode()).hexdigest()[:16]


class RepositoryMirror:
    """The local copy of one cloud model repository at ``root``."""

    def __init__(
        self,
        url: str,
        root: Path,
        *,
        env: Mapping[str, str],
        retries: int = 3,
        timeout_s: float = 30.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        source = pull.parse_source(url)
        if source.scheme not in SCHEMES:
            raise pull.UsageError(
                f"{source.display}: a model repository must be s3://bucket/prefix, gs://bucket/prefix or "
                "az://container/prefix (https:// and pvc:// sources are single models: fetch them with sluice pull)"
            )
        self.display = source.display
        self.root = root
        settings = pull.PullSettings(
            source=url, destination=root, env=env, retries=retries, timeout_s=timeout_s,
            backoff_base_s=0.5, backoff_cap_s=5.0,
        )
        self._store = puller.FsspecStore(source, settings)
        self._deadline = puller.Deadline(settings, time.monotonic)  # no deadline: the low-speed check of bodies
        self._retry = puller.Retrier(settings, sleep, random.random, self._deadline)
        self._file_tags: dict[str, str] = {}  # <model>/<file> -> file_tag of the copy in the mirror
        self._links: dict[tuple[str, int], str] = {}  # (model, version) -> store directory it points at
        # One sync at a time (a poll and load API calls run them on worker threads): two would write
        # the same temporary names and rename onto each other's directories.
        self._syncing = threading.Lock()

    # -- sync ----------------------------------------------------------------------------------
    def sync(self, only: Collection[str] | None = None) -> list[str]:
        """Bring the mirror up to date with the store (only the models in ``only``, when given); the
        names of the models whose local copy changed. Raises :class:`pull.PullError` when the store
        cannot be listed or a file cannot be fetched; what was placed before stays consistent."""
        with self._syncing:
            return self._sync(only)

    def _sync(self, only: Collection[str] | None) -> list[str]:
        self._store.invalidate()
        listing = self._retry(self.display, self._store.list)
        found = layout(listing)
        for relative in found.skipped:
            log.debug("%s: %s is not part of a model directory; ignored", self.display, relative)
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / STORE).mkdir(exist_ok=True)
        wanted = found.models if only is None else found.models & set(only)
        changed: set[str] = set()
        for (model, version), files in sorted(found.versions.items()):
            if model in wanted and self._place_version(model, version, files):
                changed.add(model)
        for relative, file in sorted(found.files.items()):
            model = relative.split("/", 1)[0]
            if model in wanted and self._place_file(relative, file):
                changed.add(model)
        changed |= self._remove_missing(found, only)
        return sorted(changed)

    def _place_version(self, model: str, version: int, files: tuple[RemoteFile, ...]) -> bool:
        prefix = f"{model}/{version}/"
        tag = version_tag(files, prefix)
        target = f"{version}-{tag}"
        link = self.root / model / str(version)
        if link.is_symlink() and os.readlink(link) == _link_target(model, target):
            self._links[(model, version)] = target
            return False
        store_dir = self.root / STORE / model / target
        if not store_dir.is_dir():
            store_dir.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{target}.partial-", dir=store_dir.parent))
            try:
                for file in files:
                    relative = file.relative.removeprefix(prefix)
                    what = f"{self.display.rstrip('/')}/{file.relative}"
                    destination = staging / relative

                    def attempt(file: RemoteFile = file, destination: Path = destination, what: str = what) -> str:
                        return puller.download(self._store, file, destination, puller.Observer(), what,
                                              watch=self._deadline.watch(what))

                    self._retry(what, attempt)
                os.rename(staging, store_dir)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        (self.root / model).mkdir(exist_ok=True)
        if link.exists() and not link.is_symlink():
            shutil.rmtree(link)  # not the mirror's (an older cache layout): the store is the truth
        temporary = link.with_name(f".{version}.link-{os.getpid()}")
        temporary.unlink(missing_ok=True)
        os.symlink(_link_target(model, target), temporary)
        os.replace(temporary, link)  # atomic: a load reads the old or the new directory, never a mix
        self._links[(model, version)] = target
        log.info("%s: fetched %s version %d (%d file(s))", self.display, model, version, len(files))
        return True

    def _place_file(self, relative: str, file: RemoteFile) -> bool:
        path = self.root / relative
        if self._file_tags.get(relative) == file_tag(file) and path.is_file():
            return False
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.partial-{os.getpid()}")
        what = f"{self.display.rstrip('/')}/{relative}"
        try:
            self._retry(what, lambda: puller.download(self._store, file, temporary, puller.Observer(), what,
                                                      watch=self._deadline.watch(what)))
            os.replace(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)
        self._file_tags[relative] = file_tag(file)
        return True

    def _remove_missing(self, found: Layout, only: Collection[str] | None) -> set[str]:
        """Remove from the mirror what the store no longer holds; the models that changed."""
        changed = set()
        for model_dir in sorted(self.root.iterdir()):
            model = model_dir.name
            if model == STORE or not model_dir.is_dir() or (only is not None and model not in only):
                continue
            if model not in found.models:
                shutil.rmtree(model_dir)  # links and model files only: the versions' files are in the store
                changed.add(model)
                continue
            for entry in sorted(model_dir.iterdir()):
                if entry.name.startswith("."):
                    continue
                if entry.name.isascii() and entry.name.isdigit() and entry.is_symlink():
                    if (model, int(entry.name)) not in found.versions:
                        entry.unlink()
                        self._links.pop((model, int(entry.name)), None)
                        changed.add(model)
                elif entry.is_file() and f"{model}/{entry.name}" not in found.files:
                    entry.unlink()
                    self._file_tags.pop(f"{model}/{entry.name}", None)
                    changed.add(model)
                elif entry.is_dir() and not entry.is_symlink() and self._prune(entry, f"{model}/{entry.name}", found):
                    changed.add(model)  # a directory beside the versions (labels/, tokenizer/): its files
        return changed

    def _prune(self, directory: Path, relative: str, found: Layout) -> bool:
        """Remove the files under ``directory`` (``relative`` to the mirror) the store no longer holds,
        and the directories that leaves empty; whether anything went."""
        removed = False
        for entry in sorted(directory.iterdir()):
            name = f"{relative}/{entry.name}"
            if entry.name.startswith("."):
                continue
            if entry.is_dir() and not entry.is_symlink():
                removed = self._prune(entry, name, found) or removed
            elif name not in found.files:
                entry.unlink()
                self._file_tags.pop(name, None)
                removed = True
        if removed and not any(directory.iterdir()):
            directory.rmdir()
        return removed

    # -- cleanup -------------------------------------------------------------------------------
    def collect(self, keep: Collection[str] = (), only: Collection[str] | None = None) -> None:
        """Remove downloaded version directories no version link points at any more, except those of
        the models in ``keep`` (an older copy of theirs may still serve: a reload that failed), and
        staging leftovers; limited to the models in ``only`` when given."""
        store = self.root / STORE
        if not store.is_dir():
            return
        for model_store in sorted(store.iterdir()):
            model = model_store.name
            if model in keep or (only is not None and model not in only):
                continue
            current = {
                os.path.basename(os.readlink(link))
                for link in (self.root / model).glob("*")
                if link.is_symlink() and link.name.isascii() and link.name.isdigit()
            } if (self.root / model).is_dir() else set()
            for entry in sorted(model_store.iterdir()):
                if entry.name not in current:
                    shutil.rmtree(entry, ignore_errors=True)
            if not any(model_store.iterdir()):
                model_store.rmdir()


def _link_target(model: str, target: str) -> str:
    """A version link's target, relative (the mirror can move, and it stays inside the repository)."""
    return f"../{STORE}/{model}/{target}"
