"""Model control (Triton's ``--model-control-mode``): who may load and unload models, and polling.

:class:`ModelControl` is what the data plane's repository calls go through and what the server
starts. ``none``: the server loads its models at start and the load/unload API is refused with
Triton's message; ``poll``: the same, and every ``--repository-poll-secs`` of the server's clock (or
when :meth:`ModelControl.poll_now` is called) the repository is scanned, compared with the last scan
(snapshot.py, pure) and added models loaded, changed ones reloaded, removed ones unloaded;
``explicit``: the load/unload API is allowed and nothing is polled.

A reload is the repository's: the new versions load beside the serving ones, requests move when
they are ready, the old ones drain and close; a failed reload leaves the old ones serving
(repository.py). With a cloud repository (mirror.py) the mirror is brought up to date before every
poll (and, in explicit mode, before an API load of that model); a store that cannot be reached keeps
everything serving, logged and counted (``sluice_repository_poll_failures_total``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path

from sluice.runtime import names, pull
from sluice.runtime.batching import Clock
from sluice.runtime.config import CONFIG_FILE_NAMES, ensemble_steps_on_disk
from sluice.runtime.errors import InvalidArgument, SluiceError, Unavailable
from sluice.runtime.mirror import RepositoryMirror
from sluice.runtime.repository import Repository, directory_stamps, entry_stamps, unless_cancelled
from sluice.runtime.snapshot import (
    Change,
    FileStamp,
    Kind,
    ModelFiles,
    PollCounts,
    Snapshot,
    changes,
    ensembles_to_retry,
)

log = logging.getLogger("sluice.runtime.watcher")

NOT_ALLOWED = "explicit model load / unload is not allowed if polling is enabled"
"""Triton's message (and status, UNAVAILABLE) for a repository load/unload outside explicit mode;
tools match on it, so it is kept word for word and Sluice's hint follows it."""


def scan_model(model_dir: Path) -> ModelFiles:
    """One model directory as it is now. Blocking."""
    config = b""
    found_config = False
    files: set[FileStamp] = set()
    versions = {}
    for entry in sorted(model_dir.iterdir()):
        if entry.name.startswith("."):
            continue  # the mirror's temporary files and links
        if entry.name in CONFIG_FILE_NAMES and entry.is_file():
            try:
                config += entry.name.encode() + b"\0" + entry.read_bytes() + b"\0"
                found_config = True
            except OSError:
                continue
        elif (version := names.version_number(entry.name)) is not None and entry.is_dir():
            versions[version] = directory_stamps(entry)
        else:
            files |= entry_stamps(entry)
    return ModelFiles(config if found_config else None, frozenset(files), versions)


def scan(root: Path, only: Collection[str] | None = None) -> Snapshot:
    """The model repository at ``root`` as it is now (only the models in ``only``, when given). Blocking."""
    snapshot = {}
    for entry in sorted(root.iterdir()):
        name = entry.name
        if names.name_problem(name) is not None or (only is not None and name not in only):
            continue
        model_dir = names.model_directory(root, name)
        if model_dir is None or not model_dir.is_dir():
            continue
        try:
            snapshot[name] = scan_model(model_dir)
        except OSError as exc:  # removed while scanning
            log.debug("repository poll: %s: %s", name, exc)
    return snapshot


class ModelControl:
    """The repository API's gate, the poll loop and the cloud mirror's refreshes."""

    def __init__(
        self,
        repository: Repository,
        mode: str,
        *,
        poll_s: float = 15.0,
        only: Collection[str] | None = None,
        mirror: RepositoryMirror | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.repository = repository
        self.mode = mode
        self.mirror = mirror
        self.counts = PollCounts()
        self._only = None if only is None else frozenset(only)
        self._poll_ns = int(poll_s * 1e9)
        self._clock: Clock = clock or time.monotonic_ns
        self._last: Snapshot = {}
        self._lock = asyncio.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[dict[str, Change]] | None = None
        self._due = 0
        self._unwatch: Callable[[], None] | None = None

    @property
    def api_allowed(self) -> bool:
        return self.mode == "explicit"

    def _refuse(self) -> None:
        if not self.api_allowed:
            raise Unavailable(
                f"{NOT_ALLOWED} (this server runs with --model-control-mode {self.mode}; "
                "the repository load/unload API needs --model-control-mode explicit)"
            )

    # -- the repository API --------------------------------------------------------------------
    async def load(self, name: str, override: str | None = None, files: Mapping[str, bytes] | None = None) -> None:
        """Load ``name`` as asked (no longer implicit), then the ensemble steps it needs that are not
        loaded (Triton loads an ensemble's composing models with it). It goes on to the end when the
        caller goes away. A failed load is 400 / INVALID_ARGUMENT, as Triton answers it."""
        self._refuse()
        try:
            await unless_cancelled(self._load(name, override, files))
        except SluiceError as exc:
            if exc.http_status < 500:
                raise
            # what the model or its backend refused does not change by trying again: not a 5xx to retry
            raise InvalidArgument(exc.message) from None

    async def _load(self, name: str, override: str | None, files: Mapping[str, bytes] | None) -> None:
        if self.mirror is not None and names.name_problem(name) is None and not files:
            await self._sync(only=[name])
        self.repository.implicit.discard(name)
        await self.repository.load(name, override, files)
        if self.mirror is not None and names.name_problem(name) is None:
            await self._collect(only=[name])
        for step in self.repository.composing_models(name):
            if self.mirror is not None and not self.repository.ready_versions(step):
                await self._sync(only=[step])
        await self.repository.load_steps(name)

    async def unload(self, name: str) -> None:
        self._refuse()
        await self.repository.unload(name)

    # -- start -----------------------------------------------------------------------------------
    async def prepare(self) -> None:
        """Before the start-up loads: the mirror up to date (raises ``pull.PullError`` when the store
        cannot be read) and, in poll mode, the first snapshot (what changes during the loads is
        picked up by the first poll)."""
        if self.mirror is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.mirror.sync, None)
        if self.mode == "poll":
            self._last = await asyncio.get_running_loop().run_in_executor(
                None, scan, self.repository.root, self._only
            )

    def start(self) -> None:
        """Poll every ``poll_s`` from now on (poll mode only; on the running loop)."""
        if self.mode != "poll" or self._poll_ns <= 0:
            return
        loop = self._loop = asyncio.get_running_loop()
        self._due = self._clock() + self._poll_ns
        self._arm()
        watch = getattr(self._clock, "watch", None)
        if watch is not None:  # a clock that jumps (tests): look at once when it does
            self._unwatch = watch(lambda: loop.call_soon_threadsafe(self._tick))

    async def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._unwatch is not None:
            self._unwatch()
        self._loop = self._timer = self._unwatch = None
        task, self._task = self._task, None
        if task is not None and not task.done():
            await asyncio.gather(task, return_exceptions=True)

    def _arm(self) -> None:
        if self._loop is None:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_later(max(self._due - self._clock(), 0) / 1e9, self._tick)

    def _tick(self) -> None:
        if self._loop is None:
            return
        if self._clock() >= self._due:
            if self._task is None or self._task.done():
                self._task = self._loop.create_task(self.poll_now())
            # due again a period from now, also when the last poll still runs (a large version syncing, a
            # slow reload): re-armed for the past deadline, the timer fired again at once, for ever
            self._due = self._clock() + self._poll_ns
        self._arm()

    # -- polling ---------------------------------------------------------------------------------
    async def poll_now(self) -> dict[str, Change]:
        """Scan the repository now and apply what changed since the last scan: load added models,
        reload changed ones, unload removed ones. Returns the changes (empty when the cloud store
        could not be read: everything goes on serving)."""
        async with self._lock:
            self.counts.polls += 1
            if self.mirror is not None and not await self._sync(only=self._only):
                return {}
            loop = asyncio.get_running_loop()
            try:
                now = await loop.run_in_executor(None, scan, self.repository.root, self._only)
            except OSError as exc:
                self._failed(f"cannot read the model repository: {exc.strerror or exc}")
                return {}
            found = changes(self._last, now)
            self._last = now
            work = []
            for name, change in found.items():
                action = "unloading" if change.kind is Kind.REMOVED else "loading"
                log.info("repository poll: model %s %s: %s", name, change.describe(), action)
                if change.kind is Kind.REMOVED:
                    work.append(self.repository.unload(name))
                else:
                    work.append(self.repository.load(name))
            await asyncio.gather(*work, return_exceptions=True)  # each failure is logged and indexed
            await self._retry_ensembles(found, now)
            if self.mirror is not None:
                await self._collect(only=self._only)
            return found

    async def _retry_ensembles(self, found: Mapping[str, Change], now: Snapshot) -> None:
        """Load again the ensembles that failed because a step model was not in the repository, once a
        poll adds it (:func:`snapshot.ensembles_to_retry`)."""
        # refused outright, or refused a reload while older versions go on serving (STALE)
        refused = {*self.repository.failed(), *self.repository.serving_stale()}
        failed = sorted(name for name in refused if name in now and name not in found)
        if not failed or not any(change.kind is Kind.ADDED for change in found.values()):
            return
        root = self.repository.root

        def steps_on_disk() -> dict[str, list[str]]:
            return {
                name: ensemble_steps_on_disk(model_dir) if (model_dir := names.model_directory(root, name)) else []
                for name in failed
            }

        steps = await asyncio.get_running_loop().run_in_executor(None, steps_on_disk)
        retry = ensembles_to_retry(found, failed, steps)
        for name in retry:
            log.info("repository poll: ensemble %s: a step model it names was added: loading again", name)
        await asyncio.gather(*(self.repository.load(name) for name in retry), return_exceptions=True)

    async def _sync(self, only: Collection[str] | None) -> bool:
        assert self.mirror is not None
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.mirror.sync, only)
        except pull.PullError as exc:
            self._failed(f"{exc}; the models loaded go on serving")
            return False
        return True

    async def _collect(self, only: Collection[str] | None) -> None:
        assert self.mirror is not None
        keep = self.repository.serving_stale()
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.mirror.collect, keep, only)
        except OSError as exc:
            log.warning("model repository cache: cannot remove old versions: %s", exc.strerror or exc)

    def _failed(self, message: str) -> None:
        self.counts.failures += 1
        self.counts.last_error = message
        log.error("repository poll failed: %s", message)


def startup_models(
    mode: str, models: Collection[str], load_models: Collection[str], on_disk: Collection[str]
) -> list[str]:
    """The models loaded at start. ``none`` and ``poll``: those named with ``--model``, else every
    model in the repository; ``explicit`` (Triton): only ``--load-model`` names (``*``: every one)
    and ``--model`` names, none without them."""
    if mode != "explicit":
        return list(models) or list(on_disk)
    wanted = [*models, *(on_disk if "*" in load_models else load_models)]
    return list(dict.fromkeys(wanted))
