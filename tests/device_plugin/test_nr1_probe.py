"""A failed NR1 probe's reason says what the probe said (issue 38.5): its stderr, else its stdout, else
'(no output)' — one bounded line without secrets — never 'probe exit 3:' with a bare colon. The reason becomes
the device's health log line, and through the NPD NR1 check a node condition's message."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from device_plugin.nr1_backend import PROBE_OUTPUT_LIMIT
from tests.device_plugin.test_nr1 import backend
from tests.sysfs_fixture import nr1_node


def reason(tmp_path: Path, script: str) -> str:
    nr1_node(tmp_path, 1)
    (tmp_path / "probe.py").write_text(script)
    b = backend(tmp_path, "--nr1-probe-command", f"{sys.executable} {tmp_path / 'probe.py'} {{pci}}")
    healthy, why = b.check(b.devices[0])
    assert not healthy
    return why


def test_stderr_is_the_reason(tmp_path: Path) -> None:
    why = reason(tmp_path, "import sys; print('ok so far'); sys.stderr.write('PHY link training failed\\n'); sys.exit(3)")
    assert why == "probe exit 3: PHY link training failed"


@pytest.mark.parametrize("script", ["import sys; sys.exit(3)", "import sys; print('   '); sys.exit(3)"])
def test_a_silent_probe_says_so(tmp_path: Path, script: str) -> None:
    assert reason(tmp_path, script) == "probe exit 3: (no output)"


def test_output_is_one_bounded_line_without_secrets(tmp_path: Path) -> None:
    why = reason(tmp_path, "import sys\n"
                           "sys.stderr.write('x' * 500 + '\\nlogin with password=hunter2 failed\\n'\n"
                           "                 '\\x1b[31mAuthorization: Bearer eyJabc.def\\x1b[0m\\n')\n"
                           "sys.exit(5)\n")
    assert "\n" not in why and "\x1b" not in why
    assert "hunter2" not in why and "eyJabc" not in why
    assert why.startswith("probe exit 5: …") and why.endswith("<redacted>")
    assert "password=<redacted> failed | " in why
    assert len(why) <= len("probe exit 5: ") + PROBE_OUTPUT_LIMIT
