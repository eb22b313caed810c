"""OpenTelemetry traces of sampled inference requests (the optional ``tracing`` extra).

The front ends call :meth:`Tracer.attach` (or :meth:`Tracer.begin` / :meth:`Trace.finish`) behind
one check of ``Tracer.on``; that flag is all tracing costs a request while it is off: no span, no
context, no header parsing. A sampled request carries a :class:`Trace` in ``InferRequest.trace``;
the scheduler, the ONNX backend, ensembles and BLS report to it through ``types.TraceHook`` the
timestamps they take anyway, and the spans are built after the fact with explicit start and end
times, so even a traced request is never wrapped in context managers on the hot path.

Span tree of one request (times from the scheduler's clock, shifted to the wall clock)::

    infer <model>            SERVER; the caller's W3C traceparent is its parent when it sent one
      queue                  enqueued -> dispatched to an instance
      batch                  dispatched -> compute start; attributes: the batch it joined
      compute_input / compute_infer / compute_output
      ensemble step <model>  one per step of an ensemble, each with its own children
      BLS <model>            one per BLS call a Python model made for it
      forward <model>        CLIENT; the call to another server (a split model's canary, a remote
                             ensemble step), whose own spans continue the trace under it
      response               the model's answer -> the response written

A decoupled request (ModelStreamInfer to a decoupled model, a decoupled BLS call) records each of
its responses as an event on its span (:meth:`Trace.responses`), which ends at its final response.

Pure parts (settings parsing and checking, ``traceparent``, sampling) are plain functions tested
without I/O. The SDK (``opentelemetry-sdk``, ``opentelemetry-exporter-otlp-proto-http``) is imported
only when tracing is first turned on.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from sluice.runtime.errors import InvalidArgument, SluiceError, Unsupported
from sluice.runtime.settings import TraceLevels, TracingSettings
from sluice.runtime.types import InferRequest, InferResponse

log = logging.getLogger("sluice.runtime.tracing")

Clock = Callable[[], int]
Done = Callable[[Any], None]
Responder = Callable[[Any, bool], None]

LEVELS = ("OFF", "TIMESTAMPS")
SETTINGS = ("trace_level", "trace_rate", "trace_count", "log_frequency", "trace_file", "trace_mode")
"""The names of Triton's trace settings (``/v2/trace/setting``, gRPC ``TraceSetting``)."""
MODE = "opentelemetry"
INSTALL_HINT = "tracing needs the OpenTelemetry SDK: pip install 'sluice[tracing]'"


class TraceConfigError(ValueError):
    """A ``--trace-config`` value Sluice cannot take; the message is one line naming it."""


# --- settings (pure) ------------------------------------------------------------------------------


_ALLOWED = {
    "trace_level": "OFF or TIMESTAMPS (TENSORS is not recorded in opentelemetry mode)",
    "trace_rate": "an integer >= 0 (trace 1 of N requests; 0: only requests with a sampled traceparent)",
    "trace_count": "an integer >= -1 (traces still to take; -1: no limit)",
    "log_frequency": "an integer >= 0",
    "trace_file": "empty: Sluice exports spans over OTLP (--trace-config opentelemetry,url=...), not to files",
    "trace_mode": "opentelemetry",
}


def _refuse(name: str, value: object) -> InvalidArgument:
    return InvalidArgument(f"trace setting '{name}': {value!r} is not allowed; allowed: {_ALLOWED[name]}")


def _integer(name: str, value: str, least: int) -> int:
    try:
        number = int(value.strip())
    except ValueError:
        raise _refuse(name, value) from None
    if number < least:
        raise _refuse(name, value)
    return number


def setting_value(name: str, values: Sequence[str]) -> Any:
    """The checked value of one trace setting given as Triton's strings; raises InvalidArgument."""
    if name not in SETTINGS:
        raise InvalidArgument(f"unknown trace setting '{name}'; allowed: {', '.join(SETTINGS)}")
    if name == "trace_level":
        levels = tuple(str(v).upper() for v in values)
        if not levels or any(level not in ("OFF", "TIMESTAMPS") for level in levels):
            raise _refuse(name, list(values))
        return ("OFF",) if "TIMESTAMPS" not in levels else ("TIMESTAMPS",)
    if len(values) != 1:
        raise _refuse(name, list(values))
    value = values[0]
    if name == "trace_rate":
        return _integer(name, value, 0)
    if name == "trace_count":
        return _integer(name, value, -1)
    if name == "log_frequency":
        return _integer(name, value, 0)
    if name == "trace_file":
        if value:
            raise _refuse(name, value)
        return ""
    if value != MODE:
        raise _refuse(name, value)
    return MODE


_FIELD = {"trace_level": "level", "trace_rate": "rate", "trace_count": "count", "log_frequency": "log_frequency"}


def updated(current: Mapping[str, Any], changes: Mapping[str, Sequence[str] | None]) -> dict[str, Any]:
    """A scope's explicit settings (``TraceLevels`` field -> value) after an API update: a value
    sets the field, None clears it (back to the server-wide value, or the start-up one). All
    changes are checked before any applies."""
    out = dict(current)
    checked = [(name, None if values is None else setting_value(name, values)) for name, values in changes.items()]
    for name, value in checked:
        field = _FIELD.get(name)
        if field is None:  # trace_file, trace_mode: checked, nothing to keep
            continue
        if value is None:
            out.pop(field, None)
        else:
            out[field] = value
    return out


def parse_trace_config(values: Iterable[str], base: TracingSettings | None = None) -> TracingSettings:
    """``--trace-config`` values in Triton's syntax: ``<setting>=<value>`` for level, rate, count and
    mode; ``opentelemetry,<setting>=<value>`` for url, resource (``key=value``, repeatable) and the
    batch span processor's ``bsp_*``. Raises TraceConfigError naming the value and what is allowed."""
    settings = base or TracingSettings()
    levels = settings.levels
    resource = dict(settings.resource)
    exporter: dict[str, Any] = {}
    for raw in values:
        section, _, rest = raw.partition(",") if "," in raw.split("=", 1)[0] else ("", "", raw)
        key, equals, value = rest.partition("=")
        key = key.strip()
        shown = f"--trace-config {raw}"
        if not equals:
            raise TraceConfigError(f"{shown}: expected [<mode>,]<setting>=<value>")
        if not section and key in ("level", "rate", "count", "mode"):
            try:
                if key == "level":
                    levels = dataclasses.replace(levels, level=setting_value("trace_level", [value]))
                elif key == "rate":
                    levels = dataclasses.replace(levels, rate=setting_value("trace_rate", [value]))
                elif key == "count":
                    levels = dataclasses.replace(levels, count=setting_value("trace_count", [value]))
                elif value != MODE:
                    raise TraceConfigError(
                        f"{shown}: mode {value!r} is not supported; allowed: opentelemetry (Triton's JSON trace "
                        "files, mode triton, are not written)"
                    )
            except InvalidArgument as exc:
                raise TraceConfigError(f"{shown}: {exc.message}") from None
        elif section == "triton":
            raise TraceConfigError(
                f"{shown}: Triton's file trace mode is not supported; use --trace-config mode=opentelemetry and "
                "--trace-config opentelemetry,url=<OTLP/HTTP endpoint>"
            )
        elif section == "opentelemetry" and key == "url":
            if not re.match(r"^https?://[^\s/]+", value):
                raise TraceConfigError(f"{shown}: allowed: an http:// or https:// URL (an OTLP/HTTP traces endpoint)")
            exporter["url"] = value
        elif section == "opentelemetry" and key == "resource":
            name, equals, attribute = value.partition("=")
            if not equals or not name.strip():
                raise TraceConfigError(f"{shown}: allowed: resource=<key>=<value>, e.g. resource=service.name=sluice")
            resource[name.strip()] = attribute
        elif section == "opentelemetry" and key in (
            "bsp_max_queue_size",
            "bsp_schedule_delay",
            "bsp_max_export_batch_size",
        ):
            if not (value.strip().isascii() and value.strip().isdigit()) or int(value) <= 0:
                raise TraceConfigError(f"{shown}: allowed: an integer > 0")
            exporter["bsp_schedule_delay_ms" if key == "bsp_schedule_delay" else key] = int(value)
        else:
            raise TraceConfigError(
                f"{shown}: unknown setting; allowed: level=, rate=, count=, mode=opentelemetry, and "
                "opentelemetry,url= / resource=<key>=<value> / bsp_max_queue_size= / bsp_schedule_delay= / "
                "bsp_max_export_batch_size="
            )
    out = dataclasses.replace(settings, levels=levels, resource=tuple(resource.items()), **exporter)
    if out.bsp_max_export_batch_size > out.bsp_max_queue_size:
        raise TraceConfigError(
            f"--trace-config opentelemetry,bsp_max_export_batch_size={out.bsp_max_export_batch_size}: allowed: at "
            f"most bsp_max_queue_size ({out.bsp_max_queue_size})"
        )
    return out


def as_triton(levels: TraceLevels, remaining: int) -> dict[str, str | list[str]]:
    """The JSON Triton answers for a scope (values are strings, the level a list)."""
    return {
        "trace_level": list(levels.level),
        "trace_rate": str(levels.rate),
        "trace_count": str(remaining),
        "log_frequency": str(levels.log_frequency),
        "trace_file": "",
        "trace_mode": MODE,
    }


# --- W3C trace context and sampling (pure) ------------------------------------------------------------

_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")


def parse_traceparent(value: str | bytes | None) -> tuple[int, int, bool] | None:
    """(trace id, parent span id, sampled) of a W3C ``traceparent`` header; None when it is absent
    or malformed (the request then starts a new trace: a bad header is never an error)."""
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    match = _TRACEPARENT.match(value.strip())
    if match is None:
        return None
    version, trace_hex, span_hex, flags_hex, rest = match.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, bool(int(flags_hex, 16) & 1)


class Sampler:
    """Triton's sampling for one scope: every ``rate``-th request, while ``count`` lasts. A request
    with a sampled ``traceparent`` is always traced (as Triton does) and counts towards neither."""

    __slots__ = ("remaining", "seen")

    def __init__(self, count: int) -> None:
        self.seen = 0
        self.remaining = count

    def sample(self, levels: TraceLevels, sampled_parent: bool) -> bool:
        if levels.level == ("OFF",):
            return False
        if sampled_parent:
            return True
        if levels.rate == 0 or self.remaining == 0:
            return False
        self.seen += 1
        if self.seen < levels.rate:
            return False
        self.seen = 0
        if self.remaining > 0:
            self.remaining -= 1
        return True


# --- runtime ----------------------------------------------------------------------------------------


class Tracer:
    """The server's tracing: settings per scope, sampling, and the SDK's tracer once turned on.

    ``on`` is the one flag the request path reads. Settings change only on the event loop (the API
    handlers), as does sampling; spans are built there too (BLS children: on the loop as well)."""

    def __init__(self, settings: TracingSettings, clock: Clock = time.monotonic_ns, exporter: Any = None) -> None:
        self.settings = settings
        self.clock = clock
        self._exporter = exporter
        self._base = settings.levels  # the start-up values a cleared server-wide setting returns to
        self._global = settings.levels
        self._models: dict[str, dict[str, Any]] = {}
        self._samplers: dict[str, Sampler] = {"": Sampler(self._global.count)}
        self._provider: Any = None
        self._otel: Any = None
        self.on = False

    def start(self) -> None:
        """Open the SDK when start-up settings turn tracing on; raises RuntimeError without it."""
        self._refresh()

    async def aclose(self) -> None:
        """Export what is still queued and stop the exporter (off the loop: it may block)."""
        provider, self._provider = self._provider, None
        self.on = False
        if provider is not None:
            import asyncio

            await asyncio.get_running_loop().run_in_executor(None, provider.shutdown)

    # -- settings API ---------------------------------------------------------------------------
    def levels(self, model: str = "") -> TraceLevels:
        explicit = self._models.get(model) if model else None
        return dataclasses.replace(self._global, **explicit) if explicit else self._global

    def _sampler(self, model: str) -> Sampler:
        # a model with settings of its own samples on its own (Triton gives it its own copy of the count)
        return self._samplers[model] if model in self._models else self._samplers[""]

    def setting(self, model: str = "") -> dict[str, str | list[str]]:
        return as_triton(self.levels(model), self._sampler(model).remaining)

    def update(self, model: str, changes: Mapping[str, Sequence[str] | None]) -> dict[str, str | list[str]]:
        """Apply Triton's trace-setting update to the server (``model`` "") or to one model; an empty
        update of a model removes its settings (it follows the server's again). Raises
        InvalidArgument for a bad setting or Unsupported when the SDK is missing (nothing changes)."""
        before = (self._global, dict(self._models), dict(self._samplers))
        # As Triton's TraceManager: every update makes the scope a new setting whose count is the one the update
        # gives, else what is left of the count it set before, else what is left of the server's; the rate's
        # request counter starts again.
        if model:
            explicit = updated(self._models.get(model, {}), changes) if changes else {}
            if explicit:
                self._models[model] = explicit
                if "count" not in explicit:
                    count = self._samplers[""].remaining
                elif changes.get("trace_count") is not None or model not in self._samplers:
                    count = explicit["count"]
                else:
                    count = self._samplers[model].remaining
                self._samplers[model] = Sampler(count)
            else:
                self._models.pop(model, None)
                self._samplers.pop(model, None)
        else:
            checked = updated({}, changes)  # every change checked first; cleared fields are absent
            fields = {field: getattr(self._global, field) for field in _FIELD.values()}
            for name, values in changes.items():
                field = _FIELD.get(name)
                if field is not None:
                    fields[field] = getattr(self._base, field) if values is None else checked[field]
            self._global = TraceLevels(**fields)
            # (Triton resets a count never set through the API to the start-up one on any server-wide
            # update; what is left is kept here: an update of the rate or level is no reason to trace again)
            self._samplers[""] = Sampler(self._global.count if "trace_count" in changes
                                         else self._samplers[""].remaining)
            # as in Triton, a model's fields it does not set follow the server's: its count too, as it stands
            for name, explicit in self._models.items():
                if "count" not in explicit:
                    self._samplers[name] = Sampler(self._samplers[""].remaining)
        try:
            self._refresh()
        except RuntimeError as exc:
            self._global, self._models, self._samplers = before
            raise Unsupported(str(exc)) from None
        return self.setting(model)

    def _refresh(self) -> None:
        wanted = self._global.level != ("OFF",) or any(self.levels(model).level != ("OFF",) for model in self._models)
        if wanted and self._otel is None:
            self._open()
        self.on = wanted

    def _open(self) -> None:
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        except ImportError:
            raise RuntimeError(INSTALL_HINT) from None
        settings = self.settings
        provider = TracerProvider(resource=Resource.create(dict(settings.resource)))
        if self._exporter is not None:  # tests: an in-memory exporter, spans there at once
            provider.add_span_processor(SimpleSpanProcessor(self._exporter))
        else:
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            except ImportError:
                raise RuntimeError(INSTALL_HINT) from None
            provider.add_span_processor(
                BatchSpanProcessor(
                    OTLPSpanExporter(endpoint=settings.url),
                    max_queue_size=settings.bsp_max_queue_size,
                    schedule_delay_millis=settings.bsp_schedule_delay_ms,
                    max_export_batch_size=settings.bsp_max_export_batch_size,
                )
            )
        self._provider = provider
        self._otel = provider.get_tracer("sluice.runtime")

    # -- the request path -------------------------------------------------------------------------
    def begin(self, request: InferRequest, traceparent: str | bytes | None, protocol: str) -> Trace | None:
        """Sample a request a front end received; returns its Trace (also in ``request.trace``) or None."""
        parent = parse_traceparent(traceparent)
        model = request.model_name
        if not self._sampler(model).sample(self.levels(model), parent is not None and parent[2]):
            return None
        from opentelemetry import trace as otel

        context = None
        if parent is not None:
            span_context = otel.SpanContext(
                parent[0], parent[1], is_remote=True, trace_flags=otel.TraceFlags(otel.TraceFlags.SAMPLED)
            )
            context = otel.set_span_in_context(otel.NonRecordingSpan(span_context))
        attributes = {"sluice.protocol": protocol}
        return self._trace(request, f"infer {model}", context, otel.SpanKind.SERVER, attributes, top=True)

    def attach(self, request: InferRequest, traceparent: str | bytes | None, done: Done, protocol: str) -> Done:
        """``begin``, and ``done`` wrapped to end the trace once the response is written."""
        trace = self.begin(request, traceparent, protocol)
        return done if trace is None else trace.wrap(done)

    def _trace(
        self, request: InferRequest, name: str, context: Any, kind: Any, attributes: dict[str, Any], top: bool
    ) -> Trace:
        now = self.clock()
        offset = time.time_ns() - now
        attributes["model_name"] = request.model_name
        if request.model_version:
            attributes["model_version"] = request.model_version
        if request.id:
            attributes["request_id"] = request.id
        if request.caller:
            attributes["sluice.caller"] = request.caller
        span = self._otel.start_span(name, context=context, kind=kind, attributes=attributes, start_time=now + offset)
        trace = Trace(self, span, offset, top)
        request.trace = trace
        return trace


class Trace:
    """One sampled request: its span (started when it was sampled) and the timestamps reported to
    it; :meth:`finish` builds the children and ends it. Implements ``types.TraceHook``."""

    __slots__ = ("_compute", "_ended", "_executed", "_offset", "_responses", "_top", "_tracer", "span", "trace_id")

    def __init__(self, tracer: Tracer, span: Any, offset: int, top: bool) -> None:
        self._tracer = tracer
        self.span = span
        self._offset = offset  # wall clock minus the scheduler's clock
        self._top = top
        self._executed: tuple[int, int, int, int, int, int] | None = None
        self._compute: tuple[int, int, int] | None = None
        self._responses = 0  # a decoupled request's responses so far
        self._ended = False
        self.trace_id = format(span.get_span_context().trace_id, "032x")

    # -- types.TraceHook ----------------------------------------------------------------------
    def executed(self, enqueued_ns: int, queue_ns: int, start_ns: int, compute_ns: int, rows: int, size: int) -> None:
        self._executed = (enqueued_ns, queue_ns, start_ns, compute_ns, rows, size)
        if self._ended:  # a decoupled model's final response came before its execute() returned
            self._phases()

    def compute_split(self, input_ns: int, infer_ns: int, output_ns: int) -> None:
        self._compute = (input_ns, infer_ns, output_ns)

    def child(self, request: InferRequest, kind: str, done: Done) -> Done:
        from opentelemetry import trace as otel

        name = f"ensemble step {request.model_name}" if kind == "ensemble_step" else f"BLS {request.model_name}"
        context = otel.set_span_in_context(self.span)
        child = self._tracer._trace(request, name, context, otel.SpanKind.INTERNAL, {"sluice.kind": kind}, top=False)
        return child.wrap(done)

    def responses(self, responder: Responder) -> Responder:
        """A decoupled request's ``responder`` wrapped: each response (or error, or bare final flag)
        becomes an event on the span, and the span ends at the final one (for the request a client
        sent, once that response is written; its ``response`` child covers the writing)."""
        clock = self._tracer.clock
        failed: list[SluiceError] = []

        def traced(item: Any, final: bool) -> None:
            answered = clock()
            try:
                responder(item, final)
            finally:
                if isinstance(item, Exception) and not failed:
                    failed.append(item if isinstance(item, SluiceError) else SluiceError(str(item)))
                self._response_event(item, final, answered)
                if final:
                    self.span.set_attribute("sluice.responses", self._responses)
                    outcome = failed[0] if failed else item
                    self.finish(outcome, answered, clock() if self._top else answered)

        return traced

    def _response_event(self, item: Any, final: bool, at_ns: int) -> None:
        attributes: dict[str, Any] = {"sluice.final": final}
        if item is None:
            name = "final flag"
        else:
            name = "response" if isinstance(item, InferResponse) else "error"
            attributes["sluice.response_index"] = self._responses
            self._responses += 1
            if not isinstance(item, InferResponse):
                attributes["sluice.error"] = getattr(item, "message", None) or str(item)
        self.span.add_event(name, attributes, timestamp=at_ns + self._offset)

    def forward(self, model: str, target: str) -> tuple[Done, str]:
        """A call this request makes to another server (``target``, host:port): a CLIENT span
        ``forward <model>``, child of this one. Returns the function that ends it (with the
        call's response or SluiceError) and the W3C ``traceparent`` to send with the call, so
        that server continues the trace under this span."""
        from opentelemetry import trace as otel

        tracer = self._tracer
        now = tracer.clock()
        span = tracer._otel.start_span(
            f"forward {model}",
            context=otel.set_span_in_context(self.span),
            kind=otel.SpanKind.CLIENT,
            attributes={"model_name": model, "sluice.kind": "forward", "sluice.target": target},
            start_time=now + self._offset,
        )
        call = Trace(tracer, span, self._offset, top=False)
        context = span.get_span_context()

        def end(outcome: Any) -> None:
            at = tracer.clock()
            call.finish(outcome, at, at)

        return end, f"00-{context.trace_id:032x}-{context.span_id:016x}-01"

    # -- ending ---------------------------------------------------------------------------------
    def wrap(self, done: Done) -> Done:
        clock = self._tracer.clock

        def traced(outcome: Any) -> None:
            answered = clock()
            try:
                done(outcome)
            finally:
                # A child ends when it is answered: what its caller does next (the ensemble's next
                # step, the rest of the BLS model) is not part of it.
                self.finish(outcome, answered, clock() if self._top else answered)

        return traced

    def finish(self, outcome: Any, answered_ns: int, ended_ns: int) -> None:
        """End the trace: ``outcome`` (response or SluiceError) came at ``answered_ns``, the response
        was written by ``ended_ns`` (the same for a child: nothing is written)."""
        if self._ended:  # a decoupled request answered twice (an error after its final response)
            return
        from opentelemetry.trace import Status, StatusCode

        span = self.span
        if self._executed is not None:
            span.set_attribute("sluice.batch_size", self._executed[4])
            self._phases()
        if self._top:
            self._child_span("response", answered_ns, ended_ns)
        if isinstance(outcome, InferResponse) and outcome.model_version:
            span.set_attribute("model_version", outcome.model_version)
        if isinstance(outcome, SluiceError):
            span.set_status(Status(StatusCode.ERROR, outcome.message))
            span.set_attribute("sluice.status", outcome.http_status)
            if self._top:
                log.log(
                    logging.WARNING if outcome.server_fault else logging.INFO,
                    "inference request for model '%s' failed (%d): %s trace_id=%s",
                    span.attributes.get("model_name", ""),
                    outcome.http_status,
                    outcome.message,
                    self.trace_id,
                )
        self._ended = True
        span.end(end_time=ended_ns + self._offset)

    def _child_span(self, name: str, start: int, end: int, attributes: dict[str, Any] | None = None) -> None:
        from opentelemetry import trace as otel

        offset = self._offset
        context = otel.set_span_in_context(self.span)
        self._tracer._otel.start_span(name, context=context, attributes=attributes, start_time=start + offset).end(
            end_time=max(end, start) + offset
        )

    def _phases(self) -> None:
        """The children built from the scheduler's timestamps: queue, batch, compute_input/infer/output
        (with the backend's split of the compute when it reported one)."""
        executed = self._executed
        assert executed is not None
        child = self._child_span
        enqueued, waited, start, compute, rows, size = executed
        dispatched = enqueued + waited
        child("queue", enqueued, dispatched)
        child("batch", dispatched, max(start, dispatched), {"sluice.batch_size": rows, "sluice.batch_requests": size})
        end = start + compute
        split = self._compute
        if split is None:
            child("compute_input", start, start)
            child("compute_infer", start, end)
            child("compute_output", end, end)
        else:
            input_ns, infer_ns, output_ns = split
            child("compute_input", start, start + input_ns)
            child("compute_infer", start + input_ns, start + input_ns + infer_ns)
            child("compute_output", max(end - output_ns, start + input_ns + infer_ns), end)


def disabled() -> Tracer:
    """A tracer that stays off (unit tests building a data plane alone)."""
    return Tracer(TracingSettings())
