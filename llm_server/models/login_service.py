"""`llm-server service install|uninstall|status`: the daemon as a login service.

macOS: a launchd LaunchAgent (~/Library/LaunchAgents), started at login and restarted when it
dies, logging under ~/Library/Logs/llm-server/. Linux: a systemd user unit
(~/.config/systemd/user). Both serve the registry file in the user's config folder.
"""

from __future__ import annotations

import argparse
import os
import plistlib
import shlex
import shutil
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from llm_server.models.registry import default_registry_path

LABEL = "com.llm-server.daemon"  # the launchd label
UNIT = "llm-server.service"  # the systemd user unit
DEFAULT_REGISTRY = """\
# Models llm-server serves (see README, Many models). Each loads on the first request naming it.
[[models]]
id = "SmolLM2-135M-Instruct"
source = "default"  # the embedded default model
pinned = true
"""


@dataclass(frozen=True)
class ServicePaths:
    """Where the service's files go under `home`."""

    home: Path
    macos: bool

    @property
    def unit_file(self) -> Path:
        if self.macos:
            return self.home / "Library" / "LaunchAgents" / f"{LABEL}.plist"
        config = os.environ.get("XDG_CONFIG_HOME") or str(self.home / ".config")
        return Path(config) / "systemd" / "user" / UNIT

    @property
    def log_dir(self) -> Path:
        if self.macos:
            return self.home / "Library" / "Logs" / "llm-server"
        return self.home / ".local" / "state" / "llm-server"


def command(registry: Path, port: int) -> list[str]:
    """The daemon's command line: the installed script beside this interpreter when present."""
    script = Path(sys.executable).parent / "llm-server"
    head = (
        [str(script)]
        if script.exists()
        else [sys.executable, "-c", "from llm_server.cli import main; main()"]
    )
    return [*head, "--models", str(registry), "--host", "127.0.0.1", "--port", str(port)]


def launchd_plist(argv: list[str], paths: ServicePaths) -> dict:
    """The LaunchAgent: runs at login, restarted whenever it exits, logs in ~/Library/Logs."""
    return {
        "Label": LABEL,
        "ProgramArguments": argv,
        "RunAtLoad": True,
        "KeepAlive": True,
        "ProcessType": "Interactive",  # inference is latency-sensitive: no background throttling
        "StandardOutPath": str(paths.log_dir / "llm-server.log"),
        "StandardErrorPath": str(paths.log_dir / "llm-server.err.log"),
        "EnvironmentVariables": {"PATH": "/usr/local/bin:/opt/homebrew/bin:/usr/bin:/bin"},
    }


def systemd_unit(argv: list[str]) -> str:
    """The user unit: started with the user's session, restarted when it fails."""
    return (
        "[Unit]\n"
        "Description=llm-server: local OpenAI-compatible model daemon\n"
        "After=network.target\n\n"
        "[Service]\n"
        f"ExecStart={shlex.join(argv)}\n"
        "Restart=on-failure\n"
        "RestartSec=2\n\n"
        "[Install]\n"
        "WantedBy=default.target\n"
    )


def install(paths: ServicePaths, registry: Path, port: int, start: bool) -> Path:
    """Write the registry (when missing) and the unit file; load it when `start`."""
    if not registry.exists():
        registry.parent.mkdir(parents=True, exist_ok=True)
        registry.write_text(DEFAULT_REGISTRY)
    paths.log_dir.mkdir(parents=True, exist_ok=True)
    paths.unit_file.parent.mkdir(parents=True, exist_ok=True)
    argv = command(registry, port)
    if paths.macos:
        with paths.unit_file.open("wb") as f:
            plistlib.dump(launchd_plist(argv, paths), f)
        if start:  # a reinstall replaces the running agent
            _run(["launchctl", "bootout", f"gui/{os.getuid()}/{LABEL}"], check=False)
            _run(["launchctl", "bootstrap", f"gui/{os.getuid()}", str(paths.unit_file)])
    else:
        paths.unit_file.write_text(systemd_unit(argv))
        if start:
            _run(["systemctl", "--user", "daemon-reload"])
            _run(["systemctl", "--user", "enable", UNIT])
            _run(["systemctl", "--user", "restart", UNIT])  # a reinstall runs the new unit
    return paths.unit_file


def uninstall(paths: ServicePaths, stop: bool) -> bool:
    """Stop the service and delete its unit file; False when none was installed."""
    if not paths.unit_file.exists():
        return False
    if stop and paths.macos:
        _run(["launchctl", "bootout", f"gui/{os.getuid()}/{LABEL}"], check=False)
    elif stop:
        _run(["systemctl", "--user", "disable", "--now", UNIT], check=False)
    paths.unit_file.unlink()
    return True


def status(paths: ServicePaths, port: int) -> str:
    """One line: installed or not, running or not, and the address answering /health."""
    if not paths.unit_file.exists():
        return f"not installed ({paths.unit_file} does not exist)"
    argv = _argv(paths)
    installed_port = argv[argv.index("--port") + 1] if "--port" in argv[:-1] else port
    url = f"http://127.0.0.1:{installed_port}"
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=3) as response:
            running = response.status == 200
    except OSError:
        running = False
    state = f"running on {url}" if running else f"installed, not answering on {url}"
    return f"{state} ({paths.unit_file})"


def _argv(paths: ServicePaths) -> list[str]:
    if paths.macos:
        with paths.unit_file.open("rb") as f:
            return list(plistlib.load(f)["ProgramArguments"])
    for line in paths.unit_file.read_text().splitlines():
        if line.startswith("ExecStart="):
            return shlex.split(line.removeprefix("ExecStart="))
    return []


def _run(cmd: list[str], check: bool = True) -> None:
    if shutil.which(cmd[0]) is None:
        print(
            f"llm-server service: {cmd[0]} not found; start the service yourself", file=sys.stderr
        )
        return
    done = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if check and done.returncode != 0:
        reason = (done.stderr or done.stdout).strip().splitlines()
        raise OSError(f"{' '.join(cmd)} failed: {reason[-1] if reason else done.returncode}")


def run(args: argparse.Namespace) -> int:
    paths = ServicePaths(Path.home(), sys.platform == "darwin")
    registry = Path(args.models).expanduser().resolve() if args.models else default_registry_path()
    if args.action == "install":
        written = install(paths, registry, args.port, start=not args.no_start)
        print(f"installed {written} (models: {registry}, http://127.0.0.1:{args.port})")
    elif args.action == "uninstall":
        removed = uninstall(paths, stop=not args.no_start)
        print(f"removed {paths.unit_file}" if removed else "not installed")
    else:
        print(status(paths, args.port))
    return 0
