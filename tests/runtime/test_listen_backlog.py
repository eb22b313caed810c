"""The listen backlog: what the server asks for, and what it says when the kernel caps it lower."""

from __future__ import annotations

from sluice.runtime.protocol.listener import BACKLOG, backlog_note, read_somaxconn


def test_a_cap_below_the_backlog_is_told_with_its_effect_and_the_setting():
    note = backlog_note(2048, 128)
    assert note is not None
    assert note.startswith("the listen backlog is 128 (net.core.somaxconn), not the 2048 Sluice asks for")
    assert "~1 s" in note and "securityContext.sysctls" in note
    assert backlog_note(2048, 2048) is None and backlog_note(2048, 4096) is None
    assert backlog_note(2048, None) is None  # unknown (not Linux): nothing to say


def test_somaxconn_is_read_from_the_namespaces_sysctl_file(tmp_path):
    sysctl = tmp_path / "somaxconn"
    sysctl.write_text("4096\n")
    assert read_somaxconn(sysctl) == 4096
    sysctl.write_text("lots\n")
    assert read_somaxconn(sysctl) is None
    assert read_somaxconn(tmp_path / "missing") is None
    assert BACKLOG == 2048
