"""Caller identity: who sent a request, the bounded set of callers that get a metrics label, and
duplicate requests.

A request names its caller with the HTTP header ``Sluice-Caller``, the gRPC metadata key
``sluice-caller`` or the V2 request parameter ``sluice_caller`` (the header wins when both are
given; the parameter is taken out of the request before any model sees it). The protocol front ends
check the value with :func:`caller_problem` / :func:`caller_from_header`; the data plane asks
:class:`CallerLabels` for the label a caller's counts go under and :class:`DuplicateWindow` whether
the same caller sent the same inputs moments ago. The counts themselves live in each model
version's statistics (stats.py) as :class:`CallerCounts`; the Prometheus collector (metrics.py)
re-ranks the labels at each scrape.

Everything here is pure or owns only its own state (no clock of its own: the duplicate window is
given one), runs on the event loop (no locks), and is bounded in memory whatever the stream of
callers: at most ``capacity`` tracked callers, ``limit`` labels, ``max_entries`` remembered requests.
"""

from __future__ import annotations

import collections
import functools
import re
from collections.abc import Callable, Hashable, Mapping, Set

from sluice.runtime.errors import Cancelled, InvalidArgument, QueueFull, QueueTimeout, Shed, SluiceError

HEADER = "Sluice-Caller"
"""The HTTP request header; over gRPC the metadata key is its lower-case form."""
METADATA_KEY = "sluice-caller"
PARAMETER = "sluice_caller"
"""The V2 request parameter (JSON ``parameters``, gRPC ``parameters`` map, ``string_param``)."""
UNKNOWN = "unknown"
"""The label of requests that name no caller."""
OTHER = "other"
"""The label of named callers outside the top ``--caller-label-limit``."""
MAX_LENGTH = 64
ALLOWED = f"1 to {MAX_LENGTH} characters of A-Z a-z 0-9 . _ : / @ - (not '{OTHER}' or '{UNKNOWN}', which are labels)"

_FORM = re.compile(rf"[A-Za-z0-9._:/@-]{{1,{MAX_LENGTH}}}")

REASONS = ("queue_full", "timeout", "shed", "cancelled", "bad_request")
"""Why a request was refused without running, as ``sluice_caller_rejected_total{reason}`` says it."""


def caller_problem(value: str) -> str | None:
    """What is wrong with ``value`` as a caller name, or None when it is allowed (pure)."""
    if not _FORM.fullmatch(value):
        return "is not allowed"
    if value in (OTHER, UNKNOWN):
        return "is reserved"
    return None


def _shown(value: str) -> str:
    return repr(value[: MAX_LENGTH + 8] + ("..." if len(value) > MAX_LENGTH + 8 else ""))


def checked(value: str, where: str) -> str:
    """``value`` when it is an allowed caller name, else InvalidArgument naming ``where`` and the form."""
    problem = caller_problem(value)
    if problem is not None:
        raise InvalidArgument(f"{where} {_shown(value)} {problem}; allowed: {ALLOWED}")
    return value


@functools.lru_cache(maxsize=1024)
def caller_from_header(raw: bytes) -> str:
    """The caller an HTTP ``Sluice-Caller`` header value names ("" for an empty value); raises
    InvalidArgument. Memoized: clients send the same few values over and over."""
    if not raw:
        return ""
    return checked(raw.decode("latin-1"), f"header {HEADER}")


def caller_from_parameter(value: object) -> str:
    """The caller the ``sluice_caller`` request parameter names; raises InvalidArgument."""
    if not isinstance(value, str):
        raise InvalidArgument(
            f"request parameter '{PARAMETER}' must be a string, got {type(value).__name__}; allowed: {ALLOWED}"
        )
    return checked(value, f"request parameter '{PARAMETER}'") if value else ""


def rejection_reason(error: SluiceError, queued: bool) -> str | None:
    """The ``reason`` label of a request refused without running, None for other failures (pure).
    ``queued``: the error came after the request was queued (from the scheduler), not at admission."""
    if isinstance(error, Cancelled):
        return "cancelled"
    if queued:
        if isinstance(error, Shed):
            return "shed"
        if isinstance(error, QueueTimeout):
            return "timeout"
        return None  # the model ran and failed, or refused the input itself
    if isinstance(error, QueueFull):
        return "queue_full"
    if isinstance(error, InvalidArgument):
        return "bad_request"
    return None


class CallerCounts:
    """One caller label's counts for one model version (updated on the event loop)."""

    __slots__ = ("cache_hits", "duplicates", "failure", "rejected", "success")

    def __init__(self) -> None:
        self.success = 0
        self.failure = 0
        self.cache_hits = 0
        self.duplicates = 0
        self.rejected: dict[str, int] = {}

    def reject(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1


class SpaceSaving:
    """Approximate request counts of the busiest callers in at most ``capacity`` entries (the
    space-saving algorithm, Metwally, Agrawal and El Abbadi 2005): a caller not tracked while the
    table is full takes the place of the least counted one, inheriting its count plus one. Every
    caller with more than ``total / capacity`` of the counts is in the table; counts are
    overestimates by at most the count they inherited. ``decay`` halves every count so the ranking
    follows recent traffic. Inserting an untracked caller into a full table costs a scan of it."""

    __slots__ = ("capacity", "counts")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self.counts: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.counts)

    def add(self, caller: str, n: int = 1) -> None:
        counts = self.counts
        count = counts.get(caller)
        if count is not None:
            counts[caller] = count + n
        elif len(counts) < self.capacity:
            counts[caller] = n
        else:
            least = min(counts, key=counts.__getitem__)
            inherited = counts.pop(least)
            counts[caller] = inherited + n

    def decay(self) -> None:
        """Halve every count; callers that reach 0 leave the table."""
        self.counts = {caller: count // 2 for caller, count in self.counts.items() if count > 1}


def choose_labels(counts: Mapping[str, int], incumbents: Set[str], limit: int) -> set[str]:
    """The callers that get a label of their own: the ``limit`` highest counts, a caller that already
    has a label winning ties (so labels do not flap between equals); places the ranking leaves free
    go to incumbents it no longer tracks (pure)."""
    ranked = sorted(counts, key=lambda caller: (-counts[caller], caller not in incumbents, caller))
    chosen = set(ranked[:limit])
    for caller in sorted(incumbents):
        if len(chosen) >= limit:
            break
        if caller not in counts:
            chosen.add(caller)
    return chosen


class CallerLabels:
    """Which callers are labels of their own in the per-caller metrics: at most ``limit``; the rest
    are counted under ``other``, requests without a caller under ``unknown``.

    A caller gets a label at once while fewer than ``limit`` are taken; otherwise :meth:`rerank`
    (at each scrape) gives the labels to the ``limit`` busiest callers by a decayed
    :class:`SpaceSaving` count. A caller keeps its label as long as it stays in that top, so its
    series stays continuous; one that drops out is counted under ``other`` from then on."""

    def __init__(self, limit: int, capacity: int | None = None) -> None:
        if limit < 0:
            raise ValueError("limit must be >= 0")
        self.limit = limit
        self.ranking = SpaceSaving(capacity or max(8 * limit, 64))
        self.labelled: set[str] = set()

    def label(self, caller: str) -> str:
        """Count one request of ``caller`` and return the label its counts go under."""
        if not caller:
            return UNKNOWN
        self.ranking.add(caller)
        labelled = self.labelled
        if caller in labelled:
            return caller
        if len(labelled) < self.limit:
            labelled.add(caller)
            return caller
        return OTHER

    def rerank(self) -> frozenset[str]:
        """Give the labels to the busiest callers, decay the ranking; returns every label in use
        (``unknown`` and ``other`` included)."""
        self.labelled = choose_labels(self.ranking.counts, self.labelled, self.limit)
        self.ranking.decay()
        return self.active()

    def active(self) -> frozenset[str]:
        return frozenset((*self.labelled, OTHER, UNKNOWN))


Clock = Callable[[], int]
"""Monotonic nanoseconds (batching.Clock; not imported: the layers keep these modules apart)."""


class DuplicateWindow:
    """Whether a request is a duplicate: the same key (caller, model, version and a digest of the
    inputs) seen less than ``window_s`` ago, on ``clock``. Remembers at most ``max_entries`` keys,
    oldest dropped first (a duplicate of a dropped key goes unnoticed)."""

    def __init__(self, window_s: float, clock: Clock, max_entries: int = 65_536) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be > 0 (0 turns duplicate detection off: pass no window)")
        self.window_ns = int(window_s * 1e9)
        self.max_entries = max_entries
        self._clock = clock
        self._seen: collections.OrderedDict[Hashable, int] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def seen(self, key: Hashable) -> bool:
        """Record ``key`` now; True when it was seen within the window before."""
        now = self._clock()
        seen = self._seen
        horizon = now - self.window_ns
        while seen:
            oldest = next(iter(seen.values()))
            if oldest > horizon:
                break
            seen.popitem(last=False)
        duplicate = seen.pop(key, None) is not None
        seen[key] = now
        if len(seen) > self.max_entries:
            seen.popitem(last=False)
        return duplicate
