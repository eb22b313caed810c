"""Triton's logging extension: the log settings clients read and change (``GET/POST /v2/logging``,
the gRPC ``LogSettings`` method), and how they act on Python logging.

:func:`updated` (pure) checks a client's changes and returns the new :class:`LogSettings`;
:func:`as_triton` is the settings as Triton reports them. :class:`LogControl` applies settings to
the ``sluice`` loggers (their level) and to the handlers it governs (a severity gate and the
format); ``__main__`` hands it the stderr handler, the server applies the start settings and puts
back what it changed when it stops. Python logging is the process's: two servers in one process
share it, as they share stderr.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping

from sluice.runtime.errors import InvalidArgument
from sluice.runtime.settings import LogSettings

FORMATS = ("default", "ISO8601")
FIELDS = ("log_file", "log_info", "log_warning", "log_error", "log_verbose_level", "log_format")
MAX_VERBOSE = 2**32 - 1  # a uint32 in Triton's gRPC message
NAMESPACE = "sluice"
"""The loggers whose level follows the settings: the runtime's and Python models' (``pb_utils.Logger``)."""

DEFAULT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
ISO8601_DATE = "%Y-%m-%dT%H:%M:%SZ"


def as_triton(settings: LogSettings) -> dict[str, str | bool | int]:
    """The settings as Triton's ``/v2/logging`` answers them."""
    return {
        "log_file": "",
        "log_info": settings.info,
        "log_warning": settings.warning,
        "log_error": settings.error,
        "log_verbose_level": settings.verbose_level,
        "log_format": settings.format,
    }


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgument(f"log setting '{name}' must be a boolean, got {value!r}; allowed: true, false")
    return value


def updated(settings: LogSettings, changes: Mapping[str, object]) -> LogSettings:
    """``settings`` with ``changes`` (Triton's names) applied; a None value leaves its setting as it
    is (Triton). Raises InvalidArgument naming the setting and what it allows (pure)."""
    new: dict[str, object] = {}
    for name, value in changes.items():
        if name not in FIELDS:
            allowed = ", ".join(FIELDS)
            raise InvalidArgument(f"unknown log setting {name[:64]!r}; allowed: {allowed}")
        if value is None:
            continue
        if name == "log_file":
            if value != "":
                raise InvalidArgument(
                    "log setting 'log_file' can't be set: Sluice writes its log to stderr only (read it with "
                    "'kubectl logs' or your container runtime); allowed: \"\""
                )
        elif name == "log_verbose_level":
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_VERBOSE:
                raise InvalidArgument(
                    f"log setting 'log_verbose_level' must be an integer from 0 to {MAX_VERBOSE}, got {value!r}; "
                    "0 turns verbose logging off, 1 or more turns it on"
                )
            new["verbose_level"] = value
        elif name == "log_format":
            if value not in FORMATS:
                raise InvalidArgument(f"log setting 'log_format' must be one of {', '.join(FORMATS)}, got {value!r}")
            new["format"] = value
        else:
            new[name.removeprefix("log_")] = _bool(name, value)
    return dataclasses.replace(settings, **new)  # type: ignore[arg-type]


def threshold(settings: LogSettings) -> int:
    """The least severity any setting lets through: the ``sluice`` loggers' level (pure)."""
    if settings.verbose_level > 0:
        return logging.DEBUG
    for enabled, level in ((settings.info, logging.INFO), (settings.warning, logging.WARNING)):
        if enabled:
            return level
    return logging.ERROR if settings.error else logging.CRITICAL + 1


def allows(settings: LogSettings, levelno: int) -> bool:
    """Whether a record of ``levelno`` is written under ``settings`` (pure): ERROR and CRITICAL
    follow ``log_error``, WARNING ``log_warning``, INFO ``log_info``, DEBUG ``log_verbose_level``."""
    if levelno >= logging.ERROR:
        return settings.error
    if levelno >= logging.WARNING:
        return settings.warning
    if levelno >= logging.INFO:
        return settings.info
    return settings.verbose_level > 0


class _Gate(logging.Filter):
    def __init__(self, control: LogControl) -> None:
        super().__init__()
        self._control = control

    def filter(self, record: logging.LogRecord) -> bool:
        return allows(self._control.settings, record.levelno)


def line_format(tag: str = "") -> str:
    """The format of Sluice's log lines; ``tag`` follows the logger's name (``worker 3``: a protocol
    worker's lines, ``sluice.runtime.http[worker 3]: ...``)."""
    return DEFAULT_FORMAT if not tag else DEFAULT_FORMAT.replace("%(name)s", f"%(name)s[{tag}]")


class _Formatter(logging.Formatter):
    """Sluice's line format, its timestamp as the settings' ``log_format`` says."""

    def __init__(self, control: LogControl, tag: str) -> None:
        super().__init__(line_format(tag))
        self._control = control

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        if self._control.settings.format == "ISO8601":
            return time.strftime(ISO8601_DATE, time.gmtime(record.created))
        return super().formatTime(record, datefmt)


class LogControl:
    """The log settings in force and their effect on Python logging. ``tag``: see :func:`line_format`."""

    def __init__(self, settings: LogSettings, tag: str = "") -> None:
        self.settings = settings
        self._gate = _Gate(self)
        self._formatter = _Formatter(self, tag)
        self._governed: list[tuple[logging.Handler, logging.Formatter | None]] = []
        self._level_before: int | None = None
        self._watchers: list[Callable[[LogSettings], None]] = []

    def watch(self, watcher: Callable[[LogSettings], None]) -> Callable[[], None]:
        """Call ``watcher`` with the settings each time they are put in force (the protocol workers follow
        the engine's); returns what stops it."""
        self._watchers.append(watcher)
        return lambda: self._watchers.remove(watcher) if watcher in self._watchers else None

    def govern(self, handler: logging.Handler) -> None:
        """Let the settings decide which records ``handler`` writes and how (the process's stderr)."""
        self._governed.append((handler, handler.formatter))
        handler.addFilter(self._gate)
        handler.setFormatter(self._formatter)

    def apply(self, settings: LogSettings | None = None) -> LogSettings:
        """Put ``settings`` (default: the current ones) in force at once; returns them."""
        if settings is not None:
            self.settings = settings
        logger = logging.getLogger(NAMESPACE)
        if self._level_before is None:
            self._level_before = logger.level
        logger.setLevel(threshold(self.settings))
        for watcher in list(self._watchers):
            watcher(self.settings)
        return self.settings

    def update(self, changes: Mapping[str, object]) -> LogSettings:
        """Apply a client's changes (Triton's names); raises InvalidArgument and changes nothing when
        one of them is wrong."""
        return self.apply(updated(self.settings, changes))

    def close(self) -> None:
        """Give back the handlers and the logger level as they were."""
        for handler, formatter in self._governed:
            handler.removeFilter(self._gate)
            handler.setFormatter(formatter)
        self._governed.clear()
        if self._level_before is not None:
            logging.getLogger(NAMESPACE).setLevel(self._level_before)
            self._level_before = None
