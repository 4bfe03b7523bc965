"""The dashboard server's safe defaults (the one `.streamlit/config.toml`, applied by the launcher) hold
whatever the working directory: it listens on loopback only, refuses a browser session whose Host header
is not a loopback name (DNS rebinding), and `python -m dashboard` stops cleanly on SIGHUP."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(180)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(cmd: list[str], cwd: Path, home: Path, port: int) -> subprocess.Popen:
    env = {**os.environ, "WEIGHTDRIFT_HOME": str(home), "STREAMLIT_BROWSER_GATHER_USAGE_STATS": "false"}
    env.pop("STREAMLIT_SERVER_ADDRESS", None)
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.Popen(
        [*cmd, "--server.port", str(port)],
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2) as r,
        ):
            if r.read() == b"ok":
                return proc
        assert proc.poll() is None, f"the server exited with {proc.returncode}"
        time.sleep(0.5)
    _stop(proc)
    pytest.fail("the server did not come up")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def _listening(pid: int, port: int) -> set[str]:
    addresses = set()
    for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        for c in p.net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port:
                addresses.add(c.laddr.ip)
    return addresses


def _session_status(port: int, host: str) -> int:
    """The HTTP status of a WebSocket handshake for the browser session, sent with Host `host`."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(
            (
                "GET /_stcore/stream HTTP/1.1\r\n"
                f"Host: {host}\r\n"
                "Upgrade: websocket\r\nConnection: Upgrade\r\n"
                "Sec-WebSocket-Key: x3JJHMbDL1EzLkh9GBhXDw==\r\nSec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )
        return int(s.recv(1024).split(b" ", 2)[1])


def test_started_elsewhere_it_listens_on_loopback_only_and_refuses_foreign_hosts(tmp_path):
    port = _free_port()
    elsewhere = tmp_path / "elsewhere"
    # a config in the working directory that would open the server to the network: the launcher's wins
    (elsewhere / ".streamlit").mkdir(parents=True)
    (elsewhere / ".streamlit" / "config.toml").write_text('[server]\naddress = "0.0.0.0"\n')
    proc = _start([sys.executable, "-m", "dashboard"], elsewhere, tmp_path / "home", port)
    try:
        assert _listening(proc.pid, port) == {"127.0.0.1"}
        assert _session_status(port, f"localhost:{port}") == 101
        assert _session_status(port, f"127.0.0.1:{port}") == 101
        assert _session_status(port, "evil.example") == 403  # a DNS-rebinding page's Host
    finally:
        _stop(proc)


def test_python_m_dashboard_serves_and_stops_on_sighup(tmp_path):
    port = _free_port()
    proc = _start([sys.executable, "-m", "dashboard"], ROOT, tmp_path / "home", port)
    try:
        assert _listening(proc.pid, port) == {"127.0.0.1"}
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(30) == 0
    finally:
        _stop(proc)


def test_the_launcher_passes_the_one_config_file_as_flags_leaving_set_variables_to_them(tmp_path):
    from dashboard.__main__ import CONFIG_PLACES, config_file, config_flags

    assert config_file() == ROOT / ".streamlit" / "config.toml" == CONFIG_PLACES[0]
    assert not (ROOT / "dashboard" / ".streamlit").exists()  # one config file, not two
    config = tmp_path / "config.toml"
    config.write_text(
        '[server]\naddress = "localhost"\nallowedHosts = ["localhost", "::1"]\nheadless = true\n'
        '[theme.light]\nprimaryColor = "#1d4ed8"\n'
    )
    assert config_flags(config, {}) == [
        "--server.address=localhost",
        "--server.allowedHosts=localhost",
        "--server.allowedHosts=::1",
        "--server.headless=true",
        "--theme.light.primaryColor=#1d4ed8",
    ]
    assert config_flags(config, {"STREAMLIT_SERVER_ADDRESS": "0.0.0.0"})[:1] == [
        "--server.allowedHosts=localhost"
    ]
