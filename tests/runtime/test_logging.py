"""Triton's logging extension: ``GET/POST /v2/logging`` and the gRPC ``LogSettings`` method through
tritonclient, the checks on bad settings, and their effect on the running server's log (the real
``sluice serve`` process, its stderr read line by line)."""

from __future__ import annotations

import json
import logging
import re
import urllib.error
import urllib.request
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from sluice.runtime import logs
from sluice.runtime.errors import InvalidArgument
from sluice.runtime.settings import LogSettings

from .conftest import write_model  # type: ignore[import-not-found]
from .test_cli_shutdown import start_ports  # type: ignore[import-not-found]

DEFAULTS = {
    "log_file": "",
    "log_info": True,
    "log_warning": True,
    "log_error": True,
    "log_verbose_level": 0,
    "log_format": "default",
}

# Logs "<IN> <level>" at every level with Triton's model logger, verbose first and error last.
LOGGING_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            mark = f"mark{int(x[0])}"
            pb_utils.Logger.log_verbose(mark + " verbose")
            pb_utils.Logger.log_info(mark + " info")
            pb_utils.Logger.log_warn(mark + " warning")
            pb_utils.Logger.log_error(mark + " error")
            out.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUT", x)]))
        return out
"""
LOGGING_CONFIG = """
name: "talker"
backend: "python"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 1 ] } ]
"""


@pytest.fixture
def server(tmp_path, serve):
    repo = tmp_path / "repo"
    write_model(repo, "talker", LOGGING_CONFIG, {"model.py": LOGGING_PY})
    return serve(repo)


def test_settings_are_read_and_changed_over_http_and_grpc_alike(server):
    http = httpclient.InferenceServerClient(server.http)
    grpc = grpcclient.InferenceServerClient(server.grpc)
    try:
        assert "logging" in http.get_server_metadata()["extensions"]
        assert http.get_log_settings() == DEFAULTS
        assert grpc.get_log_settings(as_json=True) == {
            "settings": {
                "log_file": {"string_param": ""},
                "log_info": {"bool_param": True},
                "log_warning": {"bool_param": True},
                "log_error": {"bool_param": True},
                "log_verbose_level": {"uint32_param": 0},
                "log_format": {"string_param": "default"},
            }
        }
        changed = http.update_log_settings({"log_verbose_level": 2, "log_info": False})
        assert changed == {**DEFAULTS, "log_verbose_level": 2, "log_info": False}
        # a gRPC change is what HTTP reads next, and a None value leaves its setting alone (Triton)
        answer = grpc.update_log_settings({"log_format": "ISO8601", "log_info": None}, as_json=True)
        assert answer["settings"]["log_format"] == {"string_param": "ISO8601"}
        assert answer["settings"]["log_info"] == {"bool_param": False}
        assert http.get_log_settings() == {
            **DEFAULTS,
            "log_verbose_level": 2,
            "log_info": False,
            "log_format": "ISO8601",
        }
    finally:
        http.close()
        grpc.close()


@pytest.mark.parametrize(
    ("body", "names"),
    [
        ({"log_format": "json"}, ["log_format", "default, ISO8601", "'json'"]),
        ({"log_verbose_level": -1}, ["log_verbose_level", "from 0 to 4294967295"]),
        ({"log_verbose_level": "1"}, ["log_verbose_level", "integer"]),
        ({"log_info": "yes"}, ["log_info", "true, false"]),
        ({"log_file": "/var/log/sluice.log"}, ["log_file", "stderr", 'allowed: ""']),
        ({"log_colour": True}, ["unknown log setting 'log_colour'", "log_verbose_level"]),
    ],
)
def test_bad_settings_are_400_naming_the_setting_and_what_it_allows_and_change_nothing(server, body, names):
    request = urllib.request.Request(f"http://{server.http}/v2/logging", data=json.dumps(body).encode(), method="POST")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=5)
    assert info.value.code == 400
    message = json.loads(info.value.read())["error"]
    for name in names:
        assert name in message
    client = httpclient.InferenceServerClient(server.http)
    assert client.get_log_settings() == DEFAULTS
    client.close()


def test_bad_settings_over_grpc_are_invalid_argument(server):
    client = grpcclient.InferenceServerClient(server.grpc)
    try:
        with pytest.raises(InferenceServerException) as info:
            client.update_log_settings({"log_format": "xml"})
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "log_format" in str(info.value) and "default, ISO8601" in str(info.value)
        with pytest.raises(InferenceServerException, match="log_file"):
            client.update_log_settings({"log_file": "/tmp/triton.log"})
    finally:
        client.close()


def test_a_body_that_is_not_an_object_and_a_wrong_method_are_refused(server):
    request = urllib.request.Request(f"http://{server.http}/v2/logging", data=b"[1]", method="POST")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=5)
    assert info.value.code == 400 and "JSON object" in json.loads(info.value.read())["error"]
    request = urllib.request.Request(f"http://{server.http}/v2/logging", method="DELETE")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=5)
    assert info.value.code == 405


# -- the effect on the server's log -------------------------------------------------------------


class ServerLog:
    """``sluice serve``'s stderr (merged into stdout), read up to a model's marker lines."""

    def __init__(self, proc: Any) -> None:
        self.proc = proc

    def lines_of(self, mark: str) -> list[str]:
        """The lines the model logged for ``mark``, read up to its error line (logged last)."""
        found = []
        for line in self.proc.stdout:
            if f"{mark} " in line:
                found.append(line.rstrip("\n"))
                if f"{mark} error" in line:
                    return found
        raise AssertionError(f"the server stopped before logging {mark}")


def talk(http: int, x: int) -> None:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{http}")
    tensor = httpclient.InferInput("IN", [1], "FP32")
    tensor.set_data_from_numpy(np.array([x], np.float32))
    client.infer("talker", [tensor])
    client.close()


def levels(lines: list[str]) -> list[str]:
    return [line.rsplit(" ", 1)[1] for line in lines]


def test_changes_take_effect_on_the_running_servers_log_at_once(tmp_path):
    repo = tmp_path / "repo"
    write_model(repo, "talker", LOGGING_CONFIG, {"model.py": LOGGING_PY})
    proc, ports = start_ports(repo, tmp_path, "--log-verbose", "1")
    log = ServerLog(proc)
    client = httpclient.InferenceServerClient(f"127.0.0.1:{ports['http']}")
    try:
        assert client.get_log_settings()["log_verbose_level"] == 1  # the flag is what the API reports
        talk(ports["http"], 1)
        first = log.lines_of("mark1")
        assert levels(first) == ["verbose", "info", "warning", "error"]
        assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} DEBUG sluice\.python_model: mark1 verbose", first[0])

        client.update_log_settings({"log_verbose_level": 0, "log_warning": False, "log_format": "ISO8601"})
        talk(ports["http"], 2)
        second = log.lines_of("mark2")
        assert levels(second) == ["info", "error"]
        assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ INFO sluice\.python_model: mark2 info", second[0])

        client.update_log_settings({"log_info": False, "log_warning": True, "log_verbose_level": 3})
        talk(ports["http"], 3)
        assert levels(log.lines_of("mark3")) == ["verbose", "warning", "error"]
    finally:
        client.close()
        proc.kill()
        proc.wait(10)


# -- the pure parts ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "level", "written"),
    [
        (LogSettings(), logging.DEBUG, False),
        (LogSettings(), logging.INFO, True),
        (LogSettings(verbose_level=1), logging.DEBUG, True),
        (LogSettings(info=False), logging.INFO, False),
        (LogSettings(info=False), logging.WARNING, True),
        (LogSettings(warning=False), logging.WARNING, False),
        (LogSettings(warning=False), logging.ERROR, True),
        (LogSettings(error=False), logging.CRITICAL, False),
    ],
)
def test_which_records_are_written(settings, level, written):
    assert logs.allows(settings, level) is written
    if written:  # the loggers' level lets every written record be made
        assert logs.threshold(settings) <= level


def test_threshold_is_the_least_enabled_severity():
    assert logs.threshold(LogSettings(verbose_level=2)) == logging.DEBUG
    assert logs.threshold(LogSettings(info=False)) == logging.WARNING
    assert logs.threshold(LogSettings(info=False, warning=False)) == logging.ERROR
    assert logs.threshold(LogSettings(info=False, warning=False, error=False)) > logging.CRITICAL


def test_updated_applies_only_what_it_names_and_refuses_a_bad_batch_whole():
    settings = LogSettings()
    assert logs.updated(settings, {"log_error": False, "log_file": ""}) == LogSettings(error=False)
    assert logs.updated(settings, {"log_verbose_level": None}) == settings
    with pytest.raises(InvalidArgument, match="log_format"):
        logs.updated(settings, {"log_info": False, "log_format": "iso"})


def test_a_tagged_line_names_the_tag_after_the_logger():
    record = logging.LogRecord("sluice.runtime.http", logging.WARNING, __file__, 1, "full", None, None)
    assert logging.Formatter(logs.line_format("worker 3")).format(record).endswith(
        " WARNING sluice.runtime.http[worker 3]: full"
    )
    assert logs.line_format() == logs.DEFAULT_FORMAT


def test_watchers_see_each_change_until_they_stop_watching():
    control = logs.LogControl(LogSettings())
    seen: list[LogSettings] = []
    stop = control.watch(seen.append)
    try:
        control.update({"log_format": "ISO8601"})
        with pytest.raises(InvalidArgument):
            control.update({"log_verbose_level": -1})  # refused: nothing put in force, nobody told
        stop()
        control.update({"log_info": False})
    finally:
        control.close()
    assert [s.format for s in seen] == ["ISO8601"]
