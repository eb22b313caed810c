"""Where the canary analysis gets its numbers (and its gate's answer): the I/O half of ``signals``.

A :class:`MetricsSource` reads one ``canary.Target`` and returns ``(canary, stable)``
``VersionMetrics`` over the last ``window_s``, ``None`` for a track it could not read, which
``canary.judge`` makes Inconclusive. Two of them, chosen by ``Settings.prometheus_url``:

- :class:`PrometheusSource` sends ``signals.promql``'s queries to ``/api/v1/query``;
- :class:`ScrapeSource` lists the runtime pods of each track through the reconciler's ``Api``, GETs
  each one's ``/metrics``, keeps a short history of scrapes per target in memory and subtracts
  (``signals.over_window``); after an operator restart it needs one read before it has a baseline.

:class:`GateClient` asks a canary gate webhook. Everything that can go wrong here (refused, timed
out, a non-2xx answer, a body that is not what Prometheus sends) becomes ``None`` / ``False`` and one
log line per cause, never an exception to the caller. Built by ``__main__``; called by the reconciler.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import aiohttp

from sluice.operator import signals
from sluice.operator.canary import NoBaseline, Target, VersionMetrics
from sluice.operator.reconcile import Api, ApiError

log = logging.getLogger("sluice.operator.sources")

Metrics = tuple[VersionMetrics | None, VersionMetrics | None]
SessionFactory = Callable[[], aiohttp.ClientSession]
INSTANCE = "app.kubernetes.io/instance"
INFERENCE_MODEL = "sluice.dev/inferencemodel"


class MetricsSource(Protocol):
    async def read(self, target: Target, now: float) -> Metrics:
        """``(canary, stable)`` over the ``target.window_s`` up to ``now`` (the caller's clock, seconds).
        Raises :class:`NoBaseline` when it has nothing earlier to count from (its first reading)."""
        ...


class _Once:
    """Logs a failure when its cause changes, and the recovery, instead of once per call."""

    def __init__(self) -> None:
        self._last: dict[str, str] = {}

    def failed(self, key: str, why: str) -> None:
        if self._last.get(key) != why:
            self._last[key] = why
            log.warning("%s: %s", key, why)

    def ok(self, key: str) -> None:
        if self._last.pop(key, None) is not None:
            log.info("%s: answering again", key)


class _Http:
    """One lazily opened aiohttp session (made by ``session``, in the running loop), closed by ``aclose``."""

    def __init__(self, session: SessionFactory | None, timeout_s: float) -> None:
        self._factory = session or aiohttp.ClientSession
        self._session: aiohttp.ClientSession | None = None
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = self._factory()
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _why(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class PrometheusSource:
    """Reads both tracks from Prometheus with ``signals.promql``'s six queries, sent at once and
    evaluated at Prometheus' own present (``now`` is not a wall-clock time and is not sent)."""

    def __init__(self, url: str, *, timeout_s: float = 5.0, session: SessionFactory | None = None) -> None:
        self._endpoint = url.rstrip("/") + "/api/v1/query"
        self._http = _Http(session, timeout_s)
        self._once = _Once()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def read(self, target: Target, now: float) -> Metrics:
        queries = signals.promql(target)
        answers = await asyncio.gather(*(self.query(q) for q in queries.values()))
        return signals.from_vectors(dict(zip(queries, answers, strict=True)))

    async def query(self, promql: str) -> list[dict[str, Any]] | None:
        """The instant vector ``promql`` evaluates to now; ``None`` when it could not be had."""
        key = f"Prometheus {self._endpoint}"
        try:
            async with self._http.session.get(
                self._endpoint, params={"query": promql}, timeout=self._http.timeout
            ) as resp:
                body = await resp.json(content_type=None)
                if resp.status != 200 or not isinstance(body, dict) or body.get("status") != "success":
                    error = body.get("error", "") if isinstance(body, dict) else ""
                    self._once.failed(key, f"HTTP {resp.status} {error}".rstrip())
                    return None
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            self._once.failed(key, _why(exc))
            return None
        data = body.get("data") or {}
        if data.get("resultType") != "vector" or not _is_vector(data.get("result")):
            answer = f"resultType {data.get('resultType')!r}, result {str(data.get('result'))[:100]}"
            self._once.failed(key, f"expected an instant vector of numbers, got {answer}")
            return None
        self._once.ok(key)
        return list(data["result"])


def _is_vector(result: Any) -> bool:
    """``[{"metric": {...}, "value": [time, "number"]}, ...]``, each value a number Python can read."""
    if not isinstance(result, list):
        return False
    for sample in result:
        value = sample.get("value") if isinstance(sample, dict) else None
        if not isinstance(value, list) or len(value) != 2 or not isinstance(value[1], str):
            return False
        try:
            float(value[1])
        except ValueError:
            return False
    return True


class ScrapeSource:
    """Reads both tracks from the runtime pods' own ``/metrics``, without Prometheus.

    Each read lists the namespace's pods once, keeps the Running ones with a pod IP whose
    ``app.kubernetes.io/instance`` names the track (and ``sluice.dev/inferencemodel`` the target),
    scrapes them concurrently, appends the scrape to the target's history and answers the delta
    over the window. The history keeps what the next windows can need (at most ``history`` scrapes,
    spread over the window however often it is read); :meth:`forget` drops a target's.
    """

    def __init__(
        self, kube: Api, port: int, *, timeout_s: float = 2.0, history: int = 64, session: SessionFactory | None = None
    ) -> None:
        self._kube = kube
        self._port = port
        self._http = _Http(session, timeout_s)
        self._history_len = history
        self._history: dict[tuple[str, str], collections.deque[dict[str, signals.Scrape]]] = {}
        self._once = _Once()

    async def aclose(self) -> None:
        await self._http.aclose()

    def forget(self, namespace: str, name: str) -> None:
        self._history.pop((namespace, name), None)

    async def read(self, target: Target, now: float) -> Metrics:
        key = f"scraping {target.namespace}/{target.name}"
        try:
            pods = await self._kube.list("Pod", target.namespace)
        except (TimeoutError, ApiError, aiohttp.ClientError, RuntimeError) as exc:  # no data this time
            self._once.failed(key, f"listing pods: {_why(exc)}")
            return None, None
        tracks = {signals.CANARY: target.canary_instance, signals.STABLE: target.stable_instance}
        scrapes = dict(
            zip(tracks, await asyncio.gather(*(self._scrape(pods, target, i, now) for i in tracks.values())),
                strict=True)
        )
        history = self._history.setdefault((target.namespace, target.name), collections.deque())
        history.append(scrapes)
        # keep the scrape nearest to one window back, and after it at most ``history`` spread over the
        # window (dropping the oldest instead left a long window judged on its last ``history`` reads)
        while len(history) > 2 and history[1][signals.CANARY].at <= now - target.window_s:
            history.popleft()
        while len(history) > max(self._history_len, 3):
            gaps = [history[i + 1][signals.CANARY].at - history[i - 1][signals.CANARY].at
                    for i in range(1, len(history) - 1)]
            del history[1 + gaps.index(min(gaps))]  # the read whose neighbours are closest: least lost
        self._once.ok(key)
        if len(history) < 2:
            log.info("%s: first scrape, no baseline yet: no metrics until the next read", key)
            raise NoBaseline(f"{key}: first scrape, nothing earlier to count from")
        results: list[VersionMetrics | None] = []
        for track in tracks:
            counts, span = signals.over_window([scrape[track] for scrape in history], target.window_s)
            results.append(signals.metrics_of(counts))
        if span < 0.9 * target.window_s:
            log.info("%s: the history covers %.3g s of the %.3g s window (the operator started since): "
                     "judging what it has", key, span, target.window_s)
        return results[0], results[1]

    async def _scrape(self, pods: list[dict[str, Any]], target: Target, instance: str, now: float) -> signals.Scrape:
        running = {
            pod_key: ip
            for pod in pods
            if (pod_key := _pod_key(pod)) and (ip := _running_ip(pod, target.name, instance))
        }
        texts = await asyncio.gather(*(self._get(pod_key, ip) for pod_key, ip in running.items()))
        read: dict[str, signals.Counts] = {}
        unread = set()
        for pod_key, text in zip(running, texts, strict=True):
            if text is None:
                unread.add(pod_key)
                continue
            try:
                counts = signals.parse_exposition(text, target.model)
            except ValueError as exc:
                self._once.failed(f"scraping pod {pod_key}", f"unparsable /metrics: {exc}")
                unread.add(pod_key)
                continue
            if counts is not None:
                read[pod_key] = counts
        return signals.Scrape(now, read, frozenset(unread))

    async def _get(self, pod_key: str, ip: str) -> str | None:
        host = f"[{ip}]" if ":" in ip else ip
        key = f"scraping pod {pod_key}"
        try:
            url = f"http://{host}:{self._port}/metrics"
            async with self._http.session.get(url, timeout=self._http.timeout) as resp:
                if resp.status != 200:
                    self._once.failed(key, f"HTTP {resp.status}")
                    return None
                text = await resp.text()
        except (TimeoutError, aiohttp.ClientError, UnicodeDecodeError) as exc:
            self._once.failed(key, _why(exc))
            return None
        self._once.ok(key)
        return text


def _pod_key(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata", {})
    return str(meta.get("uid") or meta.get("name") or "")


def _running_ip(pod: Mapping[str, Any], name: str, instance: str) -> str | None:
    labels = pod.get("metadata", {}).get("labels") or {}
    if labels.get(INSTANCE) != instance or labels.get(INFERENCE_MODEL) != name:
        return None
    status = pod.get("status") or {}
    if status.get("phase") != "Running" or pod.get("metadata", {}).get("deletionTimestamp"):
        return None
    return status.get("podIP") or None


class GateClient:
    """Asks a canary gate webhook: POSTs the payload as JSON; any 2xx is yes."""

    def __init__(self, *, timeout_s: float = 10.0, session: SessionFactory | None = None) -> None:
        self._http = _Http(session, timeout_s)
        self._once = _Once()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def ask(self, url: str | None, payload: Mapping[str, Any]) -> bool | None:
        """True for a 2xx answer, False for any other or none (refused, timed out); ``None``
        without a URL (nothing to ask)."""
        if not url:
            return None
        key = f"gate {url}"
        try:
            # a redirect is not a yes: not followed, answered as the status it is
            async with self._http.session.post(
                url, json=dict(payload), timeout=self._http.timeout, allow_redirects=False
            ) as resp:
                if 200 <= resp.status < 300:
                    self._once.ok(key)
                    return True
                detail = (await resp.text())[:200].strip()
                self._once.failed(key, f"said no: HTTP {resp.status}" + (f" {detail}" if detail else ""))
                return False
        except (TimeoutError, aiohttp.ClientError) as exc:
            self._once.failed(key, f"no answer: {_why(exc)}")
            return False
