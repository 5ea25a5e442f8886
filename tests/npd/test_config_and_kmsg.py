"""Node-health configuration (flag > env > file > default, errors naming the key) and the kernel-log reader,
including the real /dev/kmsg (root)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from device_plugin.config import ConfigError
from npd import kmsg
from npd.config import OPTIONS, load
from npd.state import load as load_state
from npd.state import save as save_state


def test_precedence_flag_env_file_default(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("version: v1\ngpu:\n  maxPowerRatio: 1.2\n  xidHoldTime: 2m\nplugin:\n"
                                     "  deadline: 3s\n")
    env = {"ACCELSTACK_NPD_GPU_MAX_POWER_RATIO": "1.3", "ACCELSTACK_NPD_PLUGIN_DEADLINE": "2s",
           "NODE_NAME": "from-downward-api"}
    config, _ = load(["--config-file", str(tmp_path / "c.yaml"), "--plugin-deadline", "1500ms"], environ=env)
    assert config["plugin.deadline"] == 1.5 and config.sources["plugin.deadline"] == "flag"
    assert config["gpu.maxPowerRatio"] == 1.3 and config.sources["gpu.maxPowerRatio"] == "env"
    assert config["gpu.xidHoldTime"] == 120 and config.sources["gpu.xidHoldTime"] == "file"
    assert config["gpu.maxTemperature"] == 0 and config.sources["gpu.maxTemperature"] == "default"
    assert config["node.name"] == "from-downward-api"
    assert config.section("remediation")["holdTime"] == 600


@pytest.mark.parametrize(("argv", "file", "error"), [
    (["--gpu-expected-count", "-2"], None, r"gpu\.expectedCount: must be an integer >= -1.*\(flag --gpu-expected-count\)"),
    ([], "version: v1\nnr1:\n  vendorIDs: [zz]\n", r"nr1\.vendorIDs: item 'zz'"),
    ([], "version: v1\ngpu:\n  maxPowerRatoi: 2\n", r"gpu\.maxPowerRatoi: unknown key"),
    ([], "version: v2\n", r"version: must be 'v1'"),
    (["--remediation-hold-time", "soon"], None, r"remediation\.holdTime: not a duration"),
])
def test_errors_name_the_key(tmp_path: Path, argv: list[str], file: str | None, error: str) -> None:
    if file is not None:
        (tmp_path / "c.yaml").write_text(file)
        argv = [*argv, "--config-file", str(tmp_path / "c.yaml")]
    with pytest.raises(ConfigError, match=error):
        load(argv, environ={})


def test_every_option_has_a_distinct_flag_and_env() -> None:
    assert len({o.flag_name for o in OPTIONS}) == len(OPTIONS)
    assert len({o.env_name for o in OPTIONS}) == len(OPTIONS)
    assert all(o.env_name.startswith("ACCELSTACK_NPD_") for o in OPTIONS)


def test_kmsg_records_continuations_and_sequence(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    log.write_text(
        "6,10,100,-;NVRM: loading NVIDIA UNIX x86_64 Kernel Module\n"
        "4,11,200,-;NVRM: Xid (PCI:0000:3B:00): 79, pid=0, name=, GPU has fallen off the bus.\n"
        " SUBSYSTEM=pci\n"
        " DEVICE=+pci:0000:3b:00.0\n"
        "4,12,300,-;NVRM: Xid (PCI:0000:86:00.0): 48, pid=77, DBE (0x1,0x2)\n"
        "garbage without a header\n"
        "4,13,400,-;NVRM: Xid (0000:01:00): 13, Graphics Exception\n"
    )
    events, last = kmsg.read_xids(str(log), -1)
    assert last == 13
    assert [(e.seq, e.pci, e.xid) for e in events] == [(11, "0000:3b:00", 79), (12, "0000:86:00.0", 48),
                                                       (13, "0000:01:00", 13)]
    assert events[0].text == "pid=0, name=, GPU has fallen off the bus."
    assert kmsg.read_xids(str(log), 11) == (events[1:], 13)
    assert kmsg.same_device("0000:3b:00", "0000:3b:00.0") and not kmsg.same_device("0000:3b:00", "0000:3b:01.0")
    assert kmsg.same_device("0000:86:00.0", "0000:86:00.0")


@pytest.mark.root
def test_reads_the_real_dev_kmsg_without_blocking() -> None:
    if not os.access("/dev/kmsg", os.R_OK):
        pytest.skip("/dev/kmsg not readable here")
    started = time.monotonic()
    _events, last = kmsg.read_xids("/dev/kmsg", -1)
    assert last >= 0 and time.monotonic() - started < 2
    assert kmsg.read_xids("/dev/kmsg", last)[1] >= last


def test_state_survives_and_tolerates_corruption(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "gpu.json"
    assert load_state(path) == {}
    save_state(path, {"kmsg": {"seq": 5}})
    assert load_state(path) == {"kmsg": {"seq": 5}}
    path.write_text("{not json")
    assert load_state(path) == {}


SOURCES = {"accelstack-npd-gpu": ["gpu_check.py"], "accelstack-npd-nr1": ["nr1_check.py"],
           "accelstack-device-exporter": ["exporter.py"], "accelstack-remediation": ["remediation.py"]}


@pytest.mark.parametrize("prog", sorted(SOURCES))
def test_each_process_shows_only_its_own_options(prog: str) -> None:
    """``accelstack-npd-gpu --help`` listed all four processes' flags (296 lines); each shows its own now, and
    every setting its code names is among them."""
    import re

    from npd.config import USES, build_parser, options_of

    assert set(USES) == set(SOURCES)
    own = options_of(prog)
    flags = {a.option_strings[-1] for a in build_parser(prog, "")._actions if a.option_strings}
    assert flags == {o.flag_name for o in own} | {"--help", "--config-file", "--print-config"}
    named = {m for f in SOURCES[prog]
             for m in re.findall(r"\b(?:node|log|plugin|gpu|nr1|exporter|remediation)\.[A-Za-z]+\b",
                                 (Path(__file__).resolve().parents[2] / "npd" / f).read_text())}
    keys = {o.key for o in own}
    assert named & {o.key for o in OPTIONS} <= keys, sorted(named & {o.key for o in OPTIONS} - keys)
    assert len(build_parser(prog, "").format_help().splitlines()) < 150


def test_a_process_refuses_another_ones_flag_but_reads_the_shared_file_and_environment(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One ConfigMap and one environment serve every node-health process; the flags are each process's own."""
    (tmp_path / "c.yaml").write_text("version: v1\nexporter:\n  address: ':9999'\nremediation:\n  holdTime: 1m\n"
                                     "gpu:\n  maxPowerRatio: 1.2\n")
    config, _ = load(["--config-file", str(tmp_path / "c.yaml")], environ={"ACCELSTACK_NPD_REMEDIATION_CORDON": "true"},
                     prog="accelstack-npd-gpu")
    assert config["gpu.maxPowerRatio"] == 1.2 and config["remediation.cordon"] is True
    with pytest.raises(SystemExit):
        load(["--exporter-address", ":1"], environ={}, prog="accelstack-npd-gpu")
    assert "unrecognized arguments: --exporter-address" in capsys.readouterr().err


def test_print_config_shows_the_process_own_settings(tmp_path: Path) -> None:
    from npd.config import options_of, print_config

    config, _ = load([], environ={}, prog="accelstack-remediation")
    printed = print_config(config, "accelstack-remediation")
    assert "remediation:" in printed and "gpu:" not in printed and "exporter:" not in printed
    (tmp_path / "back.yaml").write_text(printed)
    again, _ = load(["--config-file", str(tmp_path / "back.yaml")], environ={}, prog="accelstack-remediation")
    assert {o.key: again[o.key] for o in options_of("accelstack-remediation")} == {
        o.key: config[o.key] for o in options_of("accelstack-remediation")}


def test_remediation_takes_a_kubeconfig_flag_that_must_name_a_file(tmp_path: Path) -> None:
    """``--kubeconfig`` as the extender, controller, gateway and operator take it (the remediation controller
    had none: only KUBECONFIG); a path that names no file is one error naming the flag."""
    (tmp_path / "kc").write_text("apiVersion: v1\nkind: Config\n")
    config, _ = load(["--kubeconfig", str(tmp_path / "kc")], environ={}, prog="accelstack-remediation")
    assert config["remediation.kubeconfig"] == str(tmp_path / "kc")
    with pytest.raises(ConfigError, match=r"^remediation\.kubeconfig: no such file: '/no/such' \(flag --kubeconfig\)$"):
        load(["--kubeconfig", "/no/such"], environ={}, prog="accelstack-remediation")
