"""The Makefile's interpreter choice, against fake PATHs of stub interpreters.

A stub answers the Makefile's version probe (`python -c '...'`) the way that version would:
exit 0 for a supported one, 1 for Apple's 3.9. make runs with PATH holding the stubs, echo and sh.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
MAKE = shutil.which("make")
pytestmark = pytest.mark.skipif(MAKE is None, reason="no make on PATH")


def _stubs(folder: Path, versions: dict[str, bool]) -> Path:
    """`name -> supported` stubs in `folder`; returns it."""
    folder.mkdir()
    for name, supported in versions.items():
        stub = folder / name
        stub.write_text(f"#!/bin/sh\nexit {0 if supported else 1}\n")
        stub.chmod(0o755)
    return folder


def _print_python(path: Path, *args: str) -> subprocess.CompletedProcess:
    tools = path.parent / "tools"  # what the recipes run besides Python (make execs echo)
    if not tools.exists():
        tools.mkdir()
        for name in ("echo", "sh"):
            (tools / name).symlink_to(shutil.which(name))
    return subprocess.run(
        [MAKE, "-s", "--no-print-directory", "-C", str(ROOT), "print-python", *args],
        env={"PATH": f"{path}:{tools}", "HOME": "/nonexistent"},
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_only_apples_python_3_9_stops_with_one_line(tmp_path):
    out = _print_python(_stubs(tmp_path / "bin", {"python3": False, "python3.9": False}))
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "no Python 3.11-3.13 found" in lines[0]
    assert "brew install python@3.13" in lines[0]


def test_python_3_12_is_taken(tmp_path):
    folder = _stubs(tmp_path / "bin", {"python3.9": False, "python3.12": True, "python3": False})
    out = _print_python(folder)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(folder / "python3.12")


def test_newest_supported_first_and_broken_names_passed_over(tmp_path):
    """3.13 before 3.12 and 3.11; a python3.13 that does not run one (a pyenv shim of an
    uninstalled version) is skipped."""
    folder = _stubs(tmp_path / "bin", {"python3.11": True, "python3.12": True, "python3.13": True})
    assert _print_python(folder).stdout.strip() == str(folder / "python3.13")
    (folder / "python3.13").write_text("#!/bin/sh\nexit 127\n")
    assert _print_python(folder).stdout.strip() == str(folder / "python3.12")


def test_python_given_by_the_user_is_checked(tmp_path):
    folder = _stubs(tmp_path / "bin", {"python3.12": True, "old": False, "mine": True})
    out = _print_python(folder, f"PYTHON={folder / 'old'}")
    assert out.returncode != 0 and f"({folder / 'old'} is not one)" in out.stderr
    assert _print_python(folder, f"PYTHON={folder / 'mine'}").stdout.strip() == str(folder / "mine")
