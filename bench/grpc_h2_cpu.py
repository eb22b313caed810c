"""CPU of the event-loop thread per gRPC ModelInfer on the h2 front end (protocol + data-plane
submission; the model runs on worker threads and is not counted).

    python -P bench/grpc_h2_cpu.py [--requests 20000] [--pipeline 200] [--rounds 3]

Starts the server in-process on a loopback port with the add_sub ONNX model, sends pipelined
ModelInfer calls over one HTTP/2 connection from a raw-socket client, and reads the loop thread's
CPU clock before and after. CPU time, not wall time, so other load on the machine matters little;
prints the best of ``--rounds`` in microseconds per call.
"""

from __future__ import annotations

import argparse
import socket
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "runtime"))

import numpy as np  # noqa: E402
from conftest import ADD_SUB_CONFIG, BUILDERS, start_server, write_model  # noqa: E402
from hpack import Encoder  # noqa: E402
from hyperframe.frame import DataFrame, HeadersFrame, SettingsFrame, WindowUpdateFrame  # noqa: E402
from tritonclient.grpc import service_pb2 as pb  # noqa: E402

from sluice.runtime.settings import SchedulingDefaults  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--pipeline", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    repo = Path(tempfile.mkdtemp()) / "repo"
    write_model(repo, "add_sub", ADD_SUB_CONFIG, {"model.onnx": BUILDERS.add_sub_model()})
    running = start_server(repo, scheduling=SchedulingDefaults(overload_control=False))
    clock = time.pthread_getcpuclockid(running.thread.ident)
    host, port = running.grpc.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + SettingsFrame(0, {0x4: 1 << 30}).serialize())
    sock.sendall(WindowUpdateFrame(0, (1 << 30)).serialize())
    encoder = Encoder()
    message = pb.ModelInferRequest(model_name="add_sub")
    for name in ("INPUT0", "INPUT1"):
        message.inputs.add(name=name, datatype="FP32", shape=[16])
        message.raw_input_contents.append(np.arange(16, dtype=np.float32).tobytes())
    body = message.SerializeToString()
    data = bytes([0]) + len(body).to_bytes(4, "big") + body
    headers = [(":method", "POST"), (":scheme", "http"), (":path", "/inference.GRPCInferenceService/ModelInfer"),
               (":authority", "x"), ("te", "trailers"), ("content-type", "application/grpc")]
    first = encoder.encode(headers)
    block = encoder.encode(headers)  # the repeated (indexed) form clients send after the first call
    sid = 1
    results = []
    for _ in range(args.rounds):
        start = time.clock_gettime(clock)
        done = 0
        while done < args.requests:
            frames = []
            for _ in range(args.pipeline):
                frames.append(HeadersFrame(sid, first if sid == 1 else block, flags=["END_HEADERS"]).serialize())
                frames.append(DataFrame(sid, data, flags=["END_STREAM"]).serialize())
                sid += 2
            sock.sendall(b"".join(frames))
            seen = 0
            buf = b""
            while seen < args.pipeline:  # count trailers (HEADERS with END_STREAM)
                chunk = sock.recv(1 << 20)
                if not chunk:
                    raise SystemExit(f"connection closed after {seen} answers")
                buf += chunk
                while len(buf) >= 9:
                    n = int.from_bytes(buf[:3], "big")
                    if len(buf) < 9 + n:
                        break
                    if buf[3] == 1 and buf[4] & 1:
                        seen += 1
                    buf = buf[9 + n :]
            done += args.pipeline
        results.append((time.clock_gettime(clock) - start) / done * 1e6)
    sock.close()
    running.stop()
    print(f"loop-thread CPU per ModelInfer: best {min(results):.1f} us (rounds: "
          + ", ".join(f"{r:.1f}" for r in results) + ")")


if __name__ == "__main__":
    main()
