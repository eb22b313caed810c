"""``sluice pull``: download a model version into a directory, verified and placed atomically.

The thin I/O around the decisions in ``pull``: stores (fsspec for s3/gs/az, urllib for http(s), the
local file system for pvc:// and paths), the retry loop, archive unpacking and the final rename.
``__main__`` builds ``pull.PullSettings`` and calls :func:`run`; tests call :func:`pull` with a fake
sleep and their own :class:`Observer`. Imports nothing of the server.

Placement: everything is written into a hidden sibling of DESTINATION (``.<name>.sluice-pull-*``),
verified, marked (``pull.MARKER_NAME``) and renamed into place, so DESTINATION is either absent, the
previous complete model, or the new complete model; never half of one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import logging
import os
import random
import shutil
import stat
import sys
import tarfile
import tempfile
import time
import types
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any, NoReturn, Protocol, TypeVar

from sluice.runtime import pull
from sluice.runtime.pull import PullSettings, Source

log = logging.getLogger("sluice.runtime.pull")
CHUNK = 1024 * 1024
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class RemoteFile:
    key: str
    """What the store opens: an object path, a URL or a local path."""
    relative: str
    """Where it goes under the destination (POSIX, relative)."""
    size: int | None
    """Listed size; ``None`` when only the response will tell (http)."""
    whole: bool = False
    """The source is this one file (not a prefix that holds one): it keeps its name, its digest is its own
    SHA-256, and an archive is unpacked."""
    tag: str = ""
    """What the store says changes with the content (ETag, generation, last modified); empty when unknown.
    The model repository mirror (mirror.py) compares it between polls."""


class Store(Protocol):
    def list(self) -> list[RemoteFile]: ...

    def open(self, file: RemoteFile) -> contextlib.AbstractContextManager[tuple[IO[bytes], int | None]]:
        """The body and the length the server announces for it (``None``: the listed size holds)."""
        ...


@dataclasses.dataclass(frozen=True)
class Result:
    destination: Path
    digest: str
    files: int
    size: int
    skipped: bool


class Observer:
    """What a pull reports as it goes; the base does nothing. :class:`Progress` prints it."""

    def started(self, files: Sequence[RemoteFile]) -> None:
        pass

    def chunk(self, size: int) -> None:
        pass

    def file_done(self, file: RemoteFile) -> None:
        pass

    def finished(self) -> None:
        pass


class Progress(Observer):
    """A self-overwriting line on a terminal; otherwise a log line every ``interval_s``."""

    def __init__(self, *, stream: IO[str], interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._stream, self._interval, self._clock = stream, interval_s, clock
        self._tty = stream.isatty()
        self._start = self._last = clock()
        self._done = self._files_done = self._files = 0
        self._total: int | None = None

    def started(self, files: Sequence[RemoteFile]) -> None:
        self._files = len(files)
        sizes = [f.size for f in files]
        self._total = sum(s for s in sizes if s is not None) if all(s is not None for s in sizes) else None
        self._start = self._last = self._clock()

    def _report(self, force: bool = False) -> None:
        now = self._clock()
        if not force and now - self._last < (0.5 if self._tty else self._interval):
            return
        self._last = now
        line = pull.progress_line(self._done, self._total, self._files_done, self._files, now - self._start)
        if self._tty:
            self._stream.write(f"\r\x1b[K{line}")
            self._stream.flush()
        else:
            log.info("progress: %s", line)

    def chunk(self, size: int) -> None:
        self._done += size
        self._report()

    def file_done(self, file: RemoteFile) -> None:
        self._files_done += 1
        self._report()

    def finished(self) -> None:
        if self._tty:
            self._report(force=True)
            self._stream.write("\n")
            self._stream.flush()


# ---------------------------------------------------------------- stores

class FsspecStore:
    """s3://, gs://, az:// through fsspec; the protocol's library is imported here, on first use."""

    CLASSES = {"s3": ("s3fs", "S3FileSystem"), "gs": ("gcsfs.core", "GCSFileSystem"),
               "az": ("adlfs", "AzureBlobFileSystem")}
    """gcsfs's standard (JSON API) class, not the experimental one its package exports by default, which looks
    each bucket's layout up over a second, gRPC API before every operation (retried on its own schedule, and
    again on every call when that API is not allowed)."""
    LIBRARIES = {"s3": "s3fs", "gs": "gcsfs", "az": "adlfs"}

    def __init__(self, source: Source, settings: PullSettings) -> None:
        if problem := pull.storage_problem(source.scheme, settings.env):
            raise pull.UsageError(f"{source.display}: {problem}")
        module, name = self.CLASSES[source.scheme]
        try:
            fs_class = getattr(importlib.import_module(module), name)
        except ImportError as exc:
            raise pull.UsageError(
                f"{source.scheme}:// needs {self.LIBRARIES[source.scheme]}, which is not installed "
                f"(install the storage extra: pip install 'sluice[storage]'): {exc}") from None
        options = pull.storage_options(source.scheme, settings.env, timeout_s=settings.timeout_s)
        try:
            self._fs: Any = fs_class(skip_instance_cache=True, **options)
        except Exception as exc:  # adlfs checks its connection settings here (a malformed connection string)
            raise pull.UsageError(f"{source.display}: cannot set up {self.LIBRARIES[source.scheme]}: "
                                  f"{pull.describe(exc)}") from None
        _without_library_retries(self._fs, source.scheme)
        self._root = source.location.rstrip("/")
        self._source = source

    def invalidate(self) -> None:
        """Forget cached listings (s3fs keeps them): the next ``list`` asks the store."""
        self._fs.invalidate_cache()

    def list(self) -> list[RemoteFile]:
        info = self._fs.info(self._root)
        if info.get("type") == "file":
            return [RemoteFile(self._root, pull.relative_key("", self._source.name), int(info["size"]), whole=True)]
        found = self._fs.find(self._root, detail=True)
        return without_folder_markers(
            [RemoteFile(key, pull.relative_key(self._root, key), int(entry["size"]), tag=_object_tag(entry))
             for key, entry in sorted(found.items())
             if entry.get("type") == "file" and not key.endswith("/")])

    @contextlib.contextmanager
    def open(self, file: RemoteFile) -> Iterator[tuple[IO[bytes], int | None]]:
        with self._fs.open(file.key, "rb", block_size=8 * CHUNK, cache_type="readahead") as body:
            yield body, None


def without_folder_markers(files: list[RemoteFile]) -> list[RemoteFile]:
    """Drop the empty objects that stand for folders: consoles and sync tools write ``a/b/`` (gcsfs lists it with
    its slash, filtered above; adlfs strips the slash and lists ``a/b`` as an empty file). An empty object whose
    path is also the folder of other objects is such a marker: a file and a directory cannot share a path."""
    paths = [f.relative.split("/") for f in files]
    folders = {"/".join(parts[:end]) for parts in paths for end in range(1, len(parts))}
    return [f for f in files if not (f.size == 0 and f.relative in folders)]


def _without_library_retries(fs: Any, scheme: str) -> None:
    """Turn the library's own retry loop off, so every failure reaches the puller's bounded, logged retries
    (tests/runtime/test_pull_cloud.py counts the requests that reach the store to hold this)."""
    if hasattr(fs, "retries"):
        fs.retries = 1  # s3fs's loop, and gcsfs's loops that read the attribute
    if scheme == "gs":
        # gcsfs wraps each HTTP request in retry_request(retries=6), bound when the class was defined: up to
        # six attempts and ~31 s of unlogged back-off. The instance calls the undecorated coroutine instead.
        undecorated = getattr(type(fs)._request, "__wrapped__", None)
        if undecorated is None:
            log.warning("gcsfs %s: cannot turn its own retries off; they add to --retries", fs.__class__.__module__)
        else:
            fs._request = types.MethodType(undecorated, fs)
    elif scheme == "az":
        # azure-storage-blob's default: 3 more attempts, 15 s back-off growing threefold. adlfs builds the
        # client without asking; its pipeline (shared by the container and blob clients) has the policy.
        policy = getattr(getattr(getattr(fs, "service_client", None), "_config", None), "retry_policy", None)
        counts = ("total_retries", "connect_retries", "read_retries", "status_retries")
        if policy is None or not all(hasattr(policy, count) for count in counts):
            log.warning("adlfs: cannot turn the Azure SDK's own retries off; they add to --retries")
        else:
            for count in counts:
                setattr(policy, count, 0)


def _object_tag(entry: dict[str, Any]) -> str:
    """The field of an fsspec listing entry that changes with the object's content (s3fs, gcsfs, adlfs)."""
    for field in ("ETag", "etag", "generation", "md5Hash", "LastModified", "last_modified", "updated", "mtime"):
        value = entry.get(field)
        if value:
            return str(value)
    return ""


class _NoDowngrade(urllib.request.HTTPRedirectHandler):
    def __init__(self, allow_http: bool) -> None:
        self._allow_http = allow_http

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> Any:
        scheme = newurl.split(":", 1)[0].lower()
        if scheme == "http" and not self._allow_http:
            raise pull.SourceError(f"{pull.redact(req.full_url)} redirects to plain http "
                                   f"({pull.redact(newurl)}); refused without --allow-insecure-http")
        if scheme not in ("http", "https"):
            raise pull.SourceError(f"{pull.redact(req.full_url)} redirects to {scheme}:// "
                                   f"({pull.redact(newurl)}); only https (http with --allow-insecure-http) is followed")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


class HttpStore:
    """One file (or archive) over https:// (http:// with ``--allow-insecure-http``), with the stdlib."""

    def __init__(self, source: Source, settings: PullSettings) -> None:
        self._source, self._timeout = source, settings.timeout_s
        self._opener = urllib.request.build_opener(_NoDowngrade(settings.allow_insecure_http))

    def list(self) -> list[RemoteFile]:
        name = self._source.name
        if not name:
            raise pull.UsageError(f"{self._source.display}: the URL names no file; point it at one file or archive")
        return [RemoteFile(self._source.location, pull.relative_key("", name), None, whole=True)]

    @contextlib.contextmanager
    def open(self, file: RemoteFile) -> Iterator[tuple[IO[bytes], int | None]]:
        request = urllib.request.Request(file.key, headers={"User-Agent": "sluice-pull"})
        with self._opener.open(request, timeout=self._timeout) as response:
            length = response.headers.get("Content-Length")
            yield response, int(length) if length and length.isascii() and length.isdigit() else None


class LocalStore:
    """pvc:// (under ``--pvc-root``) and local paths: a file, or a directory copied recursively."""

    def __init__(self, source: Source) -> None:
        self._root = Path(source.location)

    def list(self) -> list[RemoteFile]:
        if self._root.is_file():
            return [RemoteFile(str(self._root), pull.relative_key("", self._root.name), self._root.stat().st_size,
                               whole=True)]
        if not self._root.is_dir():
            raise FileNotFoundError(f"no such file or directory: {self._root}")
        files = []
        for path in sorted(self._root.rglob("*")):
            if path.is_file():
                rel = path.relative_to(self._root).as_posix()
                files.append(RemoteFile(str(path), pull.relative_key("", rel), path.stat().st_size))
        return files

    @contextlib.contextmanager
    def open(self, file: RemoteFile) -> Iterator[tuple[IO[bytes], int | None]]:
        with open(file.key, "rb") as body:
            yield body, None


def open_store(source: Source, settings: PullSettings) -> Store:
    if source.scheme in pull.OBJECT_STORES:
        return FsspecStore(source, settings)
    if source.scheme in ("http", "https"):
        return HttpStore(source, settings)
    return LocalStore(source)


# ---------------------------------------------------------------- the pull

@contextlib.contextmanager
def _local(what: str) -> Iterator[None]:
    """Local file-system failures are the destination's fault: exit 7, never retried."""
    try:
        yield
    except OSError as exc:
        raise pull.DestinationError(f"{what}: {exc.strerror or exc}") from exc


class Deadline:
    """The clock of one pull: ``--deadline-s`` for the whole of it, and the low-speed check of each body."""

    def __init__(self, settings: PullSettings, clock: Callable[[], float]) -> None:
        self.settings, self.clock = settings, clock
        self.ends = None if settings.deadline_s is None else clock() + settings.deadline_s

    def left(self) -> float | None:
        """Seconds left, or None without a deadline."""
        return None if self.ends is None else self.ends - self.clock()

    def check(self, what: str) -> None:
        """Raise :class:`pull.DeadlineExceeded` once the deadline has passed."""
        left = self.left()
        if left is not None and left <= 0:
            self.exceeded(what)

    def exceeded(self, what: str, last: str = "") -> NoReturn:
        raise pull.DeadlineExceeded(
            f"{what}: gave up: the pull did not finish within --deadline-s {self.settings.deadline_s:g}s"
            f"{f'; last error: {last}' if last else ''}; nothing was placed")

    def watch(self, what: str) -> Callable[[int], None]:
        """A per-body check, called with each chunk's size: the deadline, then the low-speed limit over
        tumbling windows of ``low_speed_time_s`` (raises :class:`pull.Stalled`, which is retried)."""
        limit, window = self.settings.low_speed_limit, self.settings.low_speed_time_s
        since, got = self.clock(), 0

        def chunk(size: int) -> None:
            nonlocal since, got
            now = self.clock()
            if self.ends is not None and now >= self.ends:
                self.exceeded(what)
            got += size
            if window <= 0 or limit <= 0 or now - since < window:
                return
            if got < limit * (now - since):
                raise pull.Stalled(f"the body came slower than --low-speed-limit {limit} B/s: {got} bytes in "
                                   f"{now - since:.0f}s")
            since, got = now, 0

        return chunk


class Retrier:
    """Runs an operation, retrying transient failures with backoff (each retry logged), within the deadline."""

    def __init__(self, settings: PullSettings, sleep: Callable[[float], None], rand: Callable[[], float],
                 deadline: Deadline | None = None) -> None:
        self._settings, self._sleep, self._rand = settings, sleep, rand
        self._deadline = deadline or Deadline(settings, time.monotonic)

    def __call__(self, what: str, operation: Callable[[], T]) -> T:
        attempts = self._settings.retries + 1
        for attempt in range(1, attempts + 1):
            self._deadline.check(what)
            try:
                return operation()
            except pull.PullError:
                raise
            except Exception as exc:
                if not pull.is_transient(exc):
                    raise pull.permanent_error(exc, what) from None
                if attempt == attempts:
                    raise pull.GaveUp(f"{what}: gave up after {attempts} attempts; last error: "
                                      f"{pull.describe(exc)}") from None
                delay = pull.backoff_delay(attempt, base_s=self._settings.backoff_base_s,
                                           cap_s=self._settings.backoff_cap_s, random01=self._rand())
                left = self._deadline.left()
                if left is not None and delay >= left:
                    self._deadline.exceeded(what, pull.describe(exc))  # no time for another attempt
                log.warning("%s: attempt %d of %d failed (%s); retrying in %.1fs", what, attempt, attempts,
                            pull.describe(exc), delay)
                self._sleep(delay)
        raise AssertionError("unreachable")


def download(
    store: Store, file: RemoteFile, target: Path, observer: Observer, what: str, budget: int | None = None,
    watch: Callable[[int], None] | None = None,
) -> str:
    """One attempt: the file's bytes into ``target`` (truncated first); its SHA-256. More than ``budget``
    bytes (what ``--size-limit`` leaves for this file) stop it: a source that lists no size (https) or
    announces none is bounded as it streams. ``watch`` (:meth:`Deadline.watch`) sees each chunk's size.
    Bodies are read with ``read1`` where they have it (what has arrived, not a full chunk), so a trickle
    is seen as it trickles."""
    digest = hashlib.sha256()
    got = 0
    with _local(f"cannot create {target.name}"):
        target.parent.mkdir(parents=True, exist_ok=True)
        out = open(target, "wb")  # noqa: SIM115 - closed below, around the remote reads
    try:
        with store.open(file) as (body, announced):
            read = getattr(body, "read1", None) or body.read
            while chunk := read(CHUNK):
                with _local(f"cannot write {target.name}"):
                    out.write(chunk)
                digest.update(chunk)
                got += len(chunk)
                observer.chunk(len(chunk))
                if watch is not None:
                    watch(len(chunk))
                if budget is not None and got > budget:
                    raise pull.DestinationError(
                        f"{what}: more than {pull.human_bytes(budget)} came, over --size-limit; "
                        "raise the model's sizeLimit"
                    )
        pull.check_length(announced if announced is not None else file.size, got, what)
    finally:
        with _local(f"cannot write {target.name}"):
            out.close()
    return digest.hexdigest()


def _tar_kind(member: tarfile.TarInfo) -> str:
    if member.isdir():
        return "dir"
    if member.isfile():
        return "file"
    if member.issym():
        return "symlink"
    if member.islnk():
        return "hardlink"
    return "other"


def unpack(archive: Path, into: Path, *, limit: int | None, free: int | None) -> None:
    """Unpack ``archive`` (tar, gzip'd tar or zip) into ``into``, refusing unsafe members before writing any."""
    fmt = pull.archive_format(archive.name)
    try:
        if fmt == "zip":
            with zipfile.ZipFile(archive) as zipped:
                members = zipped.infolist()
                for info in members:
                    mode = info.external_attr >> 16
                    kind = "dir" if info.is_dir() else "symlink" if stat.S_ISLNK(mode) else "file"
                    if kind == "symlink":
                        raise pull.ArchiveError(f"{archive.name}: member {info.filename!r} is a symlink; zip "
                                                "symlinks are not supported, use a tar archive")
                    if problem := pull.member_problem(info.filename, kind=kind):
                        raise pull.ArchiveError(f"{archive.name}: member {info.filename!r} {problem}")
                if problem := pull.size_problem(sum(i.file_size for i in members), limit=limit, free=free):
                    raise pull.DestinationError(f"{archive.name} unpacked: {problem}")
                with _local("cannot unpack"):
                    zipped.extractall(into)
            return
        with tarfile.open(archive) as tarred:
            tar_members = tarred.getmembers()
            for member in tar_members:
                if problem := pull.member_problem(member.name, kind=_tar_kind(member), link_target=member.linkname):
                    raise pull.ArchiveError(f"{archive.name}: member {member.name!r} {problem}")
            listed = [(m.name, _tar_kind(m), m.linkname or None) for m in tar_members]
            if problem := pull.through_symlink_problem(listed):
                raise pull.ArchiveError(f"{archive.name}: {problem}, outside the model directory; refusing it")
            unpacked = sum(m.size for m in tar_members if m.isfile())
            if problem := pull.size_problem(unpacked, limit=limit, free=free):
                raise pull.DestinationError(f"{archive.name} unpacked: {problem}")
            with _local("cannot unpack"):
                tarred.extractall(into, filter="data")  # the stdlib's own checks as a second line
    except (tarfile.TarError, zipfile.BadZipFile, EOFError) as exc:
        raise pull.ArchiveError(f"{archive.name} is not a readable {fmt} archive: {exc}") from None


def _tree_digest(root: Path) -> tuple[str, int, int]:
    """(manifest digest, files, bytes) of a directory, as :func:`pull.manifest_digest` defines it."""
    entries = []
    size = 0
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink():
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(CHUNK):
                    digest.update(chunk)
            entries.append((path.relative_to(root).as_posix(), digest.hexdigest()))
            size += path.stat().st_size
    return pull.manifest_digest(entries), len(entries), size


def _free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _place(staged: Path, destination: Path) -> None:
    """Rename ``staged`` to ``destination``; a previous model there is swapped out first, then removed."""
    with _local(f"cannot place the model at {destination.name}"):
        if destination.exists() or destination.is_symlink():
            old = destination.with_name(f".{destination.name}.sluice-pull-old-{os.getpid()}")
            os.rename(destination, old)
            os.rename(staged, destination)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(staged, destination)


def pull_model(
    settings: PullSettings, *, sleep: Callable[[float], None] = time.sleep,
    rand: Callable[[], float] = random.random, observer: Observer | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Result:
    """Pull ``settings.source`` into ``settings.destination``; raises :class:`pull.PullError` on failure,
    leaving nothing at the destination that was not there before."""
    observer = observer or Observer()
    source = pull.parse_source(settings.source, allow_insecure_http=settings.allow_insecure_http,
                               pvc_root=settings.pvc_root)
    expected = pull.parse_sha256(settings.sha256) if settings.sha256 else None
    destination = settings.destination
    marker = destination / pull.MARKER_NAME
    if marker.is_file():
        with _local("cannot read the marker"):
            recorded = pull.marker_matches(marker.read_text(), source, expected)
        if recorded is not None:
            log.info("%s is already at %s (sha256:%s): nothing to do", source.display, destination, recorded)
            return Result(destination, recorded, 0, 0, skipped=True)
    if (destination.exists() or destination.is_symlink()) and not destination.is_dir():
        raise pull.DestinationError(f"{destination} exists and is not a directory; remove it or pull somewhere else "
                                    "(DESTINATION is the model's directory)")
    if destination.is_dir() and not marker.is_file() and any(destination.iterdir()):
        raise pull.DestinationError(f"{destination} exists and was not placed by sluice pull; remove it or pull "
                                    "somewhere else (a directory sluice pull placed is replaced when the source "
                                    "or checksum changes)")
    parent = destination.parent
    with _local(f"cannot create {parent}"):
        parent.mkdir(parents=True, exist_ok=True)
        for stale in parent.glob(f".{destination.name}.sluice-pull-*"):  # left by a killed run
            shutil.rmtree(stale, ignore_errors=True)
    deadline = Deadline(settings, clock)
    retry = Retrier(settings, sleep, rand, deadline)
    store = open_store(source, settings)
    files = retry(source.display, store.list)
    if not files:
        raise pull.SourceError(f"{source.display} holds no files; check the path (a prefix is pulled recursively)")
    whole = len(files) == 1 and files[0].whole
    archive = whole and pull.archive_format(files[0].relative) is not None
    free = _free_bytes(parent)
    listed = sum(f.size or 0 for f in files)
    if problem := pull.size_problem(listed, limit=None if archive else settings.size_limit, free=free):
        raise pull.DestinationError(f"{source.display}: {problem}")
    with _local(f"cannot create a staging directory next to {destination}"):
        staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.sluice-pull-", dir=parent))
    try:
        model = staging / "model"
        download_root = staging / "download" if archive else model
        log.info("pulling %s (%d file(s)%s) to %s", source.display, len(files),
                 f", {pull.human_bytes(listed)}" if all(f.size is not None for f in files) else "", destination)
        observer.started(files)
        digests = []
        limit = settings.size_limit
        if limit is not None and archive:  # the archive, not yet unpacked: its headers on top (the unpacked
            limit = limit + limit // 10 + (1 << 20)  # size is checked against the limit itself)
        used = 0
        for file in files:
            what = source.display if whole else f"{source.display.rstrip('/')}/{file.relative}"
            target = download_root / file.relative
            budget = None if limit is None else limit - used

            def attempt(file: RemoteFile = file, target: Path = target, what: str = what,
                        budget: int | None = budget) -> str:
                return download(store, file, target, observer, what, budget, deadline.watch(what))

            digests.append((file.relative, retry(what, attempt)))
            used += target.stat().st_size
            observer.file_done(file)
        observer.finished()
        # A single file or archive: its own sha256, as sha256sum prints it; a prefix: its manifest's.
        digest = digests[0][1] if whole else pull.manifest_digest(digests)
        if expected is not None and digest != expected:
            raise pull.ChecksumMismatch(
                f"{source.display}: checksum mismatch: expected sha256:{expected}, got sha256:{digest}"
                f"{'' if whole else f' (of the manifest of {len(files)} files)'}; "
                "nothing was placed")
        if archive:
            model.mkdir()
            unpack(download_root / files[0].relative, model, limit=settings.size_limit, free=_free_bytes(parent))
            shutil.rmtree(download_root, ignore_errors=True)
        _, count, size = _tree_digest(model)
        with _local("cannot write the marker"):
            (model / pull.MARKER_NAME).write_text(pull.marker_text(source, digest, count, size))
        _place(model, destination)
        return Result(destination, digest, count, size, skipped=False)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def run(settings: PullSettings) -> int:
    """The command: pull, print the digest on success, a one-line error otherwise; the exit code."""
    progress = Progress(stream=sys.stderr, interval_s=settings.progress_interval_s)
    try:
        result = pull_model(settings, observer=progress)
    except pull.PullError as exc:
        print(f"sluice pull: error: {exc}", file=sys.stderr, flush=True)
        return int(exc.exit_code)
    verb = "already present" if result.skipped else f"placed {result.files} file(s), {pull.human_bytes(result.size)}"
    print(f"sluice pull: {pull.redact(settings.source)} -> {result.destination}: {verb}; sha256:{result.digest}",
          flush=True)
    return int(pull.ExitCode.OK)
