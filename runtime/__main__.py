"""Command line: ``sluice serve --model-repository DIR`` (also ``python -m sluice.runtime serve``).

Settings are parsed here, once, into ``ServerSettings`` and passed down; nothing else reads
the command line or the environment.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from sluice.runtime.batching import BATCH_POLICIES
from sluice.runtime.settings import GRPC_SERVERS, Limits, SchedulingDefaults, ServerSettings


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description="Sluice inference server")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a Triton-style model repository over KServe V2 HTTP and gRPC")
    serve.add_argument("--model-repository", required=True, type=Path, help="directory of <model>/config.pbtxt")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all)")
    serve.add_argument("--http-port", type=int, default=8000, help="HTTP port; 0 picks a free one, -1 disables")
    serve.add_argument("--grpc-port", type=int, default=8001, help="gRPC port; 0 picks a free one, -1 disables")
    serve.add_argument("--metrics-port", type=int, default=8002, help="Prometheus port; -1 disables")
    serve.add_argument("--model", action="append", default=[], help="load only this model (repeatable)")
    serve.add_argument("--shutdown-grace-s", type=float, default=30.0, help="time in-flight requests get on stop")
    serve.add_argument(
        "--grpc-server",
        choices=GRPC_SERVERS,
        default=ServerSettings.grpc_server,
        help="gRPC front end: h2 (Sluice's own HTTP/2 server, default) or grpcio (grpc.aio fallback)",
    )
    serve.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sched = SchedulingDefaults()
    serve.add_argument(
        "--queue-timeout-us",
        type=int,
        default=sched.queue_timeout_us,
        help="server-side queue timeout for models whose config names none (0 disables)",
    )
    serve.add_argument("--max-queue-size", type=int, default=sched.max_queue_size, help="default queue bound per model")
    serve.add_argument("--batch-policy", choices=BATCH_POLICIES, default=sched.batch_policy)
    serve.add_argument(
        "--overload-control",
        choices=["on", "off"],
        default="on" if sched.overload_control else "off",
        help="shed requests that waited too long while the queue cannot drain (default on)",
    )
    serve.add_argument(
        "--response-cache-bytes",
        type=int,
        default=sched.response_cache_bytes,
        help="size bound of each cached model version's response cache",
    )
    serve.add_argument(
        "--worker-spin-us",
        type=int,
        default=sched.worker_spin_us,
        help="how long a model worker polls for the next batch before sleeping (0 = never poll)",
    )
    serve.add_argument("--overload-interval-ms", type=float, default=sched.overload_interval_ms)
    serve.add_argument("--overload-target-ms", type=float, default=sched.overload_target_ms)
    for field in dataclasses.fields(Limits):
        flag = "--" + field.name.replace("_", "-")
        serve.add_argument(
            flag,
            type=type(field.default),
            default=field.default,
            help=f"{field.metadata['help']} (default %(default)s)",
        )
    return parser


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    limits = Limits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Limits)})
    scheduling = SchedulingDefaults(
        queue_timeout_us=args.queue_timeout_us,
        max_queue_size=args.max_queue_size,
        batch_policy=args.batch_policy,
        overload_control=args.overload_control == "on",
        overload_interval_ms=args.overload_interval_ms,
        overload_target_ms=args.overload_target_ms,
        response_cache_bytes=args.response_cache_bytes,
        worker_spin_us=args.worker_spin_us,
    )
    return ServerSettings(
        model_repository=args.model_repository,
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        limits=limits,
        scheduling=scheduling,
        shutdown_grace_s=args.shutdown_grace_s,
        models=tuple(args.model),
        grpc_server=args.grpc_server,
    )


async def serve(settings: ServerSettings) -> int:
    from sluice.runtime.server import Server

    server = Server(settings)
    await server.start()
    # The request path allocates many short-lived objects that reference counting frees; the
    # cyclic collector scanning every loaded module, model and session each 700 allocations was
    # ~10% of server CPU (perf). Freeze what startup made and collect young objects less often.
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
    # A model worker that finished its native call waits for the GIL while the event loop runs
    # Python; the default 5 ms switch interval let that wait stretch every batch's completion.
    sys.setswitchinterval(0.0001)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(
        f"sluice ready: HTTP {settings.host}:{server.ports.http}  gRPC {settings.host}:{server.ports.grpc}  "
        f"metrics {settings.host}:{server.ports.metrics}",
        flush=True,
    )
    await stop.wait()
    logging.getLogger("sluice.runtime").info("stopping: finishing in-flight requests")
    await server.stop()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = settings_from_args(args)
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        runner = asyncio.run
    return runner(serve(settings))


if __name__ == "__main__":
    sys.exit(main())
