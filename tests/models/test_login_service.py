"""`llm-server service install|uninstall|status` into a temporary home: the launchd plist
(checked with plistlib) and the systemd user unit (with systemd-analyze where installed)."""

from __future__ import annotations

import os
import plistlib
import shutil
import subprocess
import sys

import pytest

from llm_server.models.daemon import resolve_source
from llm_server.models.login_service import (
    LABEL,
    ServicePaths,
    install,
    status,
    uninstall,
)
from llm_server.models.registry import load_registry

from .test_commands import _cli, _env


def test_launch_agent_plist(tmp_path):
    paths = ServicePaths(tmp_path, macos=True)
    registry = tmp_path / "config" / "models.toml"
    written = install(paths, registry, 8181, start=False)
    assert written == tmp_path / "Library" / "LaunchAgents" / f"{LABEL}.plist"
    with written.open("rb") as f:
        plist = plistlib.load(f)
    logs = tmp_path / "Library" / "Logs" / "llm-server"
    assert plist["Label"] == LABEL
    assert plist["ProgramArguments"][-6:] == [
        "--models",
        str(registry),
        "--host",
        "127.0.0.1",
        "--port",
        "8181",
    ]
    assert plist["RunAtLoad"] is True and plist["KeepAlive"] is True
    assert plist["StandardOutPath"] == str(logs / "llm-server.log")
    assert plist["StandardErrorPath"] == str(logs / "llm-server.err.log")
    assert logs.is_dir()
    (entry,) = load_registry(registry)  # a registry with the embedded model was written
    assert entry.source == "default" and entry.pinned
    assert status(paths, 8080) == f"installed, not answering on http://127.0.0.1:8181 ({written})"
    assert uninstall(paths, stop=False) and not written.exists()
    assert status(paths, 8080).startswith("not installed (")


def test_default_source_is_the_embedded_model(default_model_path):
    assert resolve_source("default") == default_model_path


def test_systemd_user_unit(tmp_path, monkeypatch):
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    paths = ServicePaths(tmp_path, macos=False)
    registry = tmp_path / "models.toml"
    registry.write_text('[[models]]\nid = "a"\nsource = "acme/a"\n')
    unit = install(paths, registry, 8182, start=False)
    assert unit == tmp_path / ".config" / "systemd" / "user" / "llm-server.service"
    text = unit.read_text()
    assert "Restart=on-failure" in text and "WantedBy=default.target" in text
    assert f"--models {registry} --host 127.0.0.1 --port 8182\n" in text
    assert registry.read_text() == '[[models]]\nid = "a"\nsource = "acme/a"\n'  # kept
    if shutil.which("systemd-analyze"):
        run = tmp_path / "run"  # the user manager's runtime folder
        run.mkdir(mode=0o700)
        done = subprocess.run(
            ["systemd-analyze", "verify", "--user", str(unit)],
            capture_output=True,
            text=True,
            env={"PATH": "/usr/bin:/bin", "XDG_RUNTIME_DIR": str(run), "HOME": str(tmp_path)},
        )
        assert done.returncode == 0, done.stderr


def test_status_of_a_running_service(tmp_path, tiny_model_path, live_server):
    srv = live_server(tiny_model_path)
    paths = ServicePaths(tmp_path, macos=sys.platform == "darwin")
    install(paths, tmp_path / "models.toml", srv.port, start=False)
    assert status(paths, 8080) == f"running on http://127.0.0.1:{srv.port} ({paths.unit_file})"


@pytest.mark.skipif(sys.platform == "darwin", reason="the Linux layout")
def test_service_verb_installs_into_home(tmp_path):
    env = _env(tmp_path)
    done = _cli(env, "service", "install", "--no-start", "--port", "8183")
    assert done.returncode == 0, done.stderr
    unit = tmp_path / "home" / ".config" / "systemd" / "user" / "llm-server.service"
    registry = tmp_path / "home" / ".config" / "llm-server" / "models.toml"
    assert done.stdout == f"installed {unit} (models: {registry}, http://127.0.0.1:8183)\n"
    assert unit.is_file() and registry.is_file()
    stat = _cli(env, "service", "status")
    assert stat.stdout == f"installed, not answering on http://127.0.0.1:8183 ({unit})\n"
    gone = _cli(env, "service", "uninstall", "--no-start")
    assert gone.stdout == f"removed {unit}\n" and not unit.exists()


def _fake_systemctl(tmp_path, code: int) -> dict[str, str]:
    """A systemctl on PATH that records its arguments and exits `code`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "systemctl.log"
    script = bin_dir / "systemctl"
    script.write_text(
        f'#!/bin/sh\necho "$@" >> {log}\n'
        f'[ {code} -eq 0 ] || {{ echo "Failed to connect to bus" >&2; exit {code}; }}\n'
    )
    script.chmod(0o755)
    return _env(tmp_path, PATH=f"{bin_dir}:{os.environ['PATH']}")


@pytest.mark.skipif(sys.platform == "darwin", reason="the Linux layout")
def test_install_enables_and_restarts_the_user_unit(tmp_path):
    env = _fake_systemctl(tmp_path, 0)
    done = _cli(env, "service", "install")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "systemctl.log").read_text().splitlines() == [
        "--user daemon-reload",
        "--user enable llm-server.service",
        "--user restart llm-server.service",
    ]
    assert _cli(env, "service", "uninstall").returncode == 0
    assert (tmp_path / "systemctl.log").read_text().splitlines()[-1] == (
        "--user disable --now llm-server.service"
    )


@pytest.mark.skipif(sys.platform == "darwin", reason="the Linux layout")
def test_install_without_a_user_manager_is_one_line(tmp_path):
    done = _cli(_fake_systemctl(tmp_path, 1), "service", "install")
    assert done.returncode == 1
    assert done.stderr == (
        "llm-server service: systemctl --user daemon-reload failed: Failed to connect to bus\n"
    )
