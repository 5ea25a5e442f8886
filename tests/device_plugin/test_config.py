"""Configuration: precedence flag > env > file > default, and a clear error naming the key for bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from device_plugin.config import ConfigError, load

GOOD = """\
version: v1
flags:
  sysfsRoot: /host/sys
  failOnInitError: false
nvidia:
  sharing:
    replicas: 4
    allocationPolicy: packed
  health:
    ignoredXids: [13, 31, 94]
    recoveryPeriod: 2m
nr1:
  enabled: true
  vendorIDs: ["1E2D"]
"""


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def test_defaults() -> None:
    config, _ = load([], environ={})
    assert config["nvidia.resourceName"] == "nvidia.com/gpu"
    assert config["nvidia.health.ignoredXids"] == [13, 31, 43, 45, 68, 109]
    assert config["nvidia.sharing.replicas"] == 1
    assert config["flags.failOnInitError"] is True
    assert config["nr1.enabled"] is False
    assert set(config.sources.values()) == {"default"}


def test_file_values_are_parsed(tmp_path: Path) -> None:
    config, _ = load(["--config-file", write(tmp_path, GOOD)], environ={})
    assert config["flags.sysfsRoot"] == "/host/sys"
    assert config["nvidia.sharing.replicas"] == 4
    assert config["nvidia.health.ignoredXids"] == [13, 31, 94]
    assert config["nvidia.health.recoveryPeriod"] == 120.0
    assert config["nr1.vendorIDs"] == ["0x1e2d"]
    assert config.sources["nvidia.sharing.replicas"] == "file"


def test_precedence_flag_over_env_over_file(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    env = {"ACCELSTACK_DP_NVIDIA_SHARING_REPLICAS": "8", "ACCELSTACK_DP_SYSFS_ROOT": "/env/sys",
           "ACCELSTACK_DP_CONFIG_FILE": path}
    config, _ = load(["--nvidia-sharing-replicas", "2"], environ=env)
    assert config["nvidia.sharing.replicas"] == 2 and config.sources["nvidia.sharing.replicas"] == "flag"
    assert config["flags.sysfsRoot"] == "/env/sys" and config.sources["flags.sysfsRoot"] == "env"
    assert config["nvidia.sharing.allocationPolicy"] == "packed"  # file, untouched by env/flags


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("version: v2\n", "version: must be 'v1'"),
        ("flags: {}\n", "version: must be 'v1', got None"),
        ("version: v1\nflags:\n  renameByDefault: true\n", "flags.renameByDefault: unknown key"),
        ("version: v1\nsharing:\n  timeSlicing: {}\n", "sharing.timeSlicing: unknown key (top-level sections"),
        ("version: v1\nnvidia:\n  sharing:\n    replicas: 0\n", "nvidia.sharing.replicas: must be an integer between 1 and 64, got 0"),
        ("version: v1\nnvidia:\n  sharing:\n    replicas: two\n", "nvidia.sharing.replicas: must be an integer"),
        ("version: v1\nnvidia:\n  sharing:\n    allocationPolicy: spread\n", "nvidia.sharing.allocationPolicy: must be one of distributed, packed"),
        ("version: v1\nnvidia:\n  health:\n    ignoredXids: [13, x]\n", "nvidia.health.ignoredXids: item 'x'"),
        ("version: v1\nnvidia:\n  health:\n    recoveryPeriod: soon\n", "nvidia.health.recoveryPeriod: not a duration"),
        ("version: v1\nnvidia:\n  resourceName: gpu\n", "nvidia.resourceName: not an extended resource name"),
        ("version: v1\nnvidia:\n  deviceListStrategy: [volume-mounts]\n", "nvidia.deviceListStrategy: item 'volume-mounts'"),
        ("version: v1\nnr1:\n  enabled: true\n", "nr1.vendorIDs: required when nr1.enabled"),
        ("version: v1\nnr1:\n  enabled: true\n  vendorIDs: [xyz]\n", "nr1.vendorIDs: item 'xyz'"),
        ("version: v1\nflags:\n  failOnInitError: maybe\n", "flags.failOnInitError: not a boolean"),
        ("version: v1\nflags:\n  metricsAddress: nowhere\n", "flags.metricsAddress: must be host:port"),
        ("version: v1\nnvidia:\n  enabled: false\n", "at least one backend must be enabled"),
        ("version: v1\nnvidia: [1, 2]\n", "nvidia: unknown key"),
        ("- just\n- a list\n", "the top level must be a mapping"),
        ("version: v1\nflags: {sysfsRoot: [a]}\n", "flags.sysfsRoot: must be a string"),
        ("version: v1\nnvidia:\n  sharing: {replicas: 2\n", "not valid YAML (line"),
    ],
)
def test_bad_file_names_the_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load(["--config-file", write(tmp_path, text)], environ={})
    assert message in str(err.value)


def test_bad_env_and_flag_name_their_source() -> None:
    with pytest.raises(ConfigError, match=r"nvidia.sharing.replicas: .* \(env ACCELSTACK_DP_NVIDIA_SHARING_REPLICAS\)"):
        load([], environ={"ACCELSTACK_DP_NVIDIA_SHARING_REPLICAS": "-1"})
    with pytest.raises(ConfigError, match=r"flags.registerRetry: .* \(flag --register-retry\)"):
        load(["--register-retry=-5s"], environ={})
    with pytest.raises(ConfigError, match="config file /does/not/exist"):
        load(["--config-file", "/does/not/exist"], environ={})


def test_cli_reports_config_errors_with_exit_2(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "device_plugin.main", "--nvidia-sharing-replicas", "0"]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert result.returncode == 2
    assert "configuration error: nvidia.sharing.replicas" in result.stderr
    assert "Traceback" not in result.stderr
    result = subprocess.run([sys.executable, "-m", "device_plugin.main", "--no-such-flag"], capture_output=True,
                            text=True, check=False)
    assert result.returncode == 2 and "unrecognized arguments: --no-such-flag" in result.stderr


def test_print_config_and_help(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "device_plugin.main", "--config-file", write(tmp_path, GOOD),
                          "--print-config"], capture_output=True, text=True, check=True).stdout
    assert "version: v1" in out and "replicas: 4" in out and "sysfsRoot: /host/sys" in out
    help_text = subprocess.run([sys.executable, "-m", "device_plugin.main", "--help"], capture_output=True,
                               text=True, check=True).stdout
    assert "--nvidia-sharing-replicas" in help_text and "ACCELSTACK_DP_NVIDIA_SHARING_REPLICAS" in help_text


@pytest.mark.parametrize(("seconds", "text"), [
    (5.0, "5s"), (0.5, "500ms"), (90.0, "1m30s"), (300.0, "5m"), (3600.0, "1h"), (0.0, "0s"), (90.5, "1m30.5s"),
    (3725.0, "1h2m5s"), (0.003, "3ms"), (1e-05, "0.00001s")])
def test_durations_are_written_as_the_docs_write_them(seconds: float, text: str) -> None:
    from device_plugin.config import format_duration, parse_duration

    assert format_duration(seconds) == text and parse_duration(text) == seconds


def test_go_compound_durations_parse() -> None:
    from device_plugin.config import parse_duration

    assert parse_duration("1m30s") == 90 and parse_duration("1h5m") == 3900 and parse_duration("2s500ms") == 2.5
    for bad in ("1m 30s", "m30s", "1x", "30s1", "-1m30s"):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_every_duration_reads_back_to_the_same_value() -> None:
    from hypothesis import given
    from hypothesis import strategies as st

    from device_plugin.config import format_duration, parse_duration

    @given(st.one_of(st.floats(min_value=0, max_value=1e9, allow_nan=False),
                     st.integers(min_value=0, max_value=10**9).map(lambda ms: ms / 1000)))
    def roundtrip(seconds: float) -> None:
        assert parse_duration(format_duration(seconds)) == seconds

    roundtrip()


def test_print_config_writes_durations_as_the_docs_and_reads_back_the_same(tmp_path: Path) -> None:
    """``registerRetry: 5.0`` where the docs write ``5s``: the printed file uses the documented form and, loaded
    as a config file, gives the very same configuration."""
    from device_plugin.config import SCHEMA

    config, _ = load(["--config-file", write(tmp_path, GOOD), "--nvidia-health-recovery-period", "90",
                      "--nr1-health-interval", "250ms"], environ={})
    printed = SCHEMA.print_tree(config)
    for line in ("registerRetry: 5s", "recoveryPeriod: 1m30s", "healthInterval: 250ms", "interval: 1m"):
        assert f"  {line}\n" in printed, printed
    (tmp_path / "printed.yaml").write_text(printed)
    again, _ = load(["--config-file", str(tmp_path / "printed.yaml")], environ={})
    assert again.values == config.values
    assert "default '5s'" in " ".join(subprocess.run(
        [sys.executable, "-m", "device_plugin.main", "--help"], capture_output=True, text=True, check=True).stdout.split())


@pytest.mark.parametrize("prog", ["accelstack-npd-gpu", "accelstack-npd-nr1", "accelstack-device-exporter",
                                  "accelstack-remediation"])
def test_node_health_print_config_reads_back_the_same(tmp_path: Path, prog: str) -> None:
    from device_plugin.config import format_duration, parse_duration
    from npd.config import load as npd_load
    from npd.config import options_of, print_config

    config, _ = npd_load(["--log-level", "debug"], environ={"NODE_NAME": "n1"}, prog=prog)
    printed = print_config(config, prog)
    for option in options_of(prog):
        if option.parse is parse_duration:
            leaf = option.key.rsplit(".", 1)[1]
            assert f"  {leaf}: {format_duration(config[option.key])}\n" in printed, (option.key, printed)
    (tmp_path / "printed.yaml").write_text(printed)
    again, _ = npd_load(["--config-file", str(tmp_path / "printed.yaml")], environ={}, prog=prog)
    assert {o.key: again[o.key] for o in options_of(prog)} == {o.key: config[o.key] for o in options_of(prog)}
