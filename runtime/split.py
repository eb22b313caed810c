"""An exact weighted traffic split, for canaries without a service mesh.

The stable pods' runtime forwards a weighted share of its requests to the canary Service (over the
remote path ensembles already use); :class:`WeightedSplit` decides which ones. It is a credit
counter, not a coin: after any ``n`` requests the canary has had ``floor(n * percent / 100)`` of
them, so the split is exact to within one request at every moment and spread evenly (5 % is every
20th request), where a random choice drifts by ``sqrt(n)`` and a replica-proportional split can
only take the ratios replica counts allow (bench/split_accuracy.py measures both). One instance per
model and event loop; no lock (the loop is one thread).

Also here: :func:`parse_split_file` (the ``--split-file`` JSON -> routes) and :class:`SplitTable`
(the live split per model, which a new file reweighs). forwarding.py reads the file and forwards;
everything here is pure: no I/O.
"""

from __future__ import annotations

import dataclasses
import json
import zlib

from sluice.runtime import names


class WeightedSplit:
    def __init__(self, percent: int) -> None:
        if not 0 <= percent <= 100:
            raise ValueError(f"percent must be from 0 to 100, got {percent}")
        self.percent = percent
        self._credit = 0

    def to_canary(self) -> bool:
        """Whether the next request goes to the canary."""
        self._credit += self.percent
        if self._credit >= 100:
            self._credit -= 100
            return True
        return False

    def reweigh(self, percent: int) -> None:
        """Move to a new weight (a canary step) without a burst: the credit carried over is kept
        below one request."""
        if not 0 <= percent <= 100:
            raise ValueError(f"percent must be from 0 to 100, got {percent}")
        self.percent = percent
        self._credit = min(self._credit, 99)


# --- the split file (pure) -----------------------------------------------------------------------

SPLIT_FILE_FORMAT = '{"models": {"<model>": {"target": "<host>:<port>", "percent": <0..100>}}}'
"""What ``--split-file`` holds (the operator writes it into a ConfigMap mounted into stable pods)."""


@dataclasses.dataclass(frozen=True)
class Route:
    """Where a model's canary share goes: a KServe V2 gRPC endpoint, and the share in percent."""

    target: str
    percent: int


class SplitFileError(ValueError):
    """An invalid split file; the message names the file, the field and what is allowed."""

    def __init__(self, source: str, field: str | None, problem: str) -> None:
        where = f"split file {source}" + (f": field '{field}'" if field else "")
        super().__init__(f"{where}: {problem}")
        self.field = field
        self.problem = problem


_TARGET = "'<host>:<port>' of a KServe V2 gRPC endpoint"


def _target_problem(target: str) -> str | None:
    """What is wrong with ``target`` as ``host:port``, or None."""
    host, sep, port = target.rpartition(":")
    if not sep or not host:
        return "it has no port"
    if host.startswith("["):
        if not host.endswith("]") or len(host) < 3:
            return "an IPv6 address must be written [address]"
    elif not all(c.isalnum() or c in ".-_" for c in host):
        return "the host may hold only letters, digits, '.', '-' and '_' (no scheme, path or spaces)"
    if not port.isdigit() or not port.isascii() or not 1 <= int(port) <= 65535:
        return f"port {port!r} is not a number from 1 to 65535"
    return None


def parse_split_file(text: str | bytes, source: str) -> dict[str, Route]:
    """The routes a split file names (model -> Route); raises SplitFileError naming ``source`` (the
    file's path, for logs only) and the field. An empty ``models`` object is a valid file: no split."""
    try:
        document = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise SplitFileError(source, None, f"not valid JSON ({exc}); expected {SPLIT_FILE_FORMAT}") from None
    if not isinstance(document, dict):
        raise SplitFileError(source, None, f"expected a JSON object, {SPLIT_FILE_FORMAT}")
    unknown = sorted(set(document) - {"models"})
    if unknown:
        raise SplitFileError(source, unknown[0], "unknown key; allowed: 'models'")
    models = document.get("models")
    if not isinstance(models, dict):
        got = "missing" if models is None else f"a {type(models).__name__}"
        raise SplitFileError(source, "models", f"{got}; expected an object of model name -> {{target, percent}}")
    routes = {}
    for model, entry in models.items():
        field = f"models.{names.shown(model)}"
        problem = names.name_problem(model)
        if problem is not None:
            raise SplitFileError(source, field, f"{problem}; allowed: {names.ALLOWED}")
        if not isinstance(entry, dict):
            raise SplitFileError(source, field, 'expected an object {"target": "<host>:<port>", "percent": <0..100>}')
        unknown = sorted(set(entry) - {"target", "percent"})
        if unknown:
            raise SplitFileError(source, f"{field}.{unknown[0]}", "unknown key; allowed: 'target', 'percent'")
        target = entry.get("target")
        if not isinstance(target, str):
            got = "missing" if target is None else f"{target!r} is not a string"
            raise SplitFileError(source, f"{field}.target", f"{got}; expected {_TARGET}")
        problem = _target_problem(target)
        if problem is not None:
            raise SplitFileError(source, f"{field}.target", f"{target!r}: {problem}; expected {_TARGET}")
        percent = entry.get("percent")
        if isinstance(percent, bool) or not isinstance(percent, int) or not 0 <= percent <= 100:
            got = "missing" if percent is None else f"{percent!r} is not allowed"
            raise SplitFileError(source, f"{field}.percent", f"{got}; allowed: an integer from 0 to 100")
        routes[model] = Route(target, percent)
    return routes


# --- the live split --------------------------------------------------------------------------------


class ModelSplit:
    """The split of one model now: its canary target and the credit counter that decides."""

    __slots__ = ("target", "weights")

    def __init__(self, route: Route) -> None:
        self.target = route.target
        self.weights = WeightedSplit(route.percent)

    def to_canary(self) -> bool:
        return self.weights.to_canary()

    def routes_to_canary(self, sequence_id: object) -> bool:
        """Whether a request goes to the canary. A request of a sequence (a non-zero ``sequence_id``)
        goes where its sequence's bucket says (:func:`sequence_bucket`), so all of a sequence's
        requests reach the same server, and every stable replica routes it alike; other requests by
        the credit counter."""
        if sequence_id is not None and sequence_id != 0 and sequence_id != "":
            return sequence_bucket(sequence_id) < self.weights.percent
        return self.weights.to_canary()

    @property
    def percent(self) -> int:
        return self.weights.percent


def sequence_bucket(sequence_id: object) -> int:
    """0..99 for a sequence's correlation id (int or string), the same in every process (not
    Python's salted ``hash``): a split at P percent sends the sequences of buckets below P to the canary."""
    return zlib.crc32(str(sequence_id).encode("utf-8", "surrogatepass")) % 100


class SplitTable:
    """Model name -> :class:`ModelSplit`, for the models that have a split. ``models`` is the same
    dict for the table's life (the data plane holds it: an empty dict is its whole cost without a
    split); ``apply`` changes it in place."""

    def __init__(self) -> None:
        self.models: dict[str, ModelSplit] = {}

    def apply(self, routes: dict[str, Route]) -> list[str]:
        """Move to ``routes``: a model already split keeps its counter and is reweighed (no burst,
        also when its target moves); the rest are added or dropped. Returns what changed, one
        line per model, for the log."""
        changes = []
        for model in sorted(set(self.models) - set(routes)):
            del self.models[model]
            changes.append(f"{names.shown(model)}: no split")
        for model, route in routes.items():
            live = self.models.get(model)
            if live is None:
                self.models[model] = ModelSplit(route)
            elif (live.target, live.percent) == (route.target, route.percent):
                continue
            else:
                live.weights.reweigh(route.percent)
                live.target = route.target
            changes.append(f"{names.shown(model)}: {route.percent}% to {route.target}")
        return changes
