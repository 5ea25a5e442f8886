"""The GPU check's logic at the pynvml function boundary (FakeNVML), with sysfs and kernel-log fixtures."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pynvml
import pytest
from hypothesis import given
from hypothesis import strategies as st

from npd.gpu_check import check_gpus, parse_checks
from npd.plugin import NONOK, OK, UNKNOWN, Progress, Result, fit, run_with_deadline, truncate, word_cut
from tests.apiserver_peer import APIServerPeer
from tests.fake_nvml import FakeNVML, dgx_like
from tests.npd.helpers import kmsg_line, nvidia_functions, values, xid_line

ALL = ("count", "xid", "ecc", "pages", "temperature", "power")


@pytest.fixture
def node(tmp_path: Path) -> tuple[Path, FakeNVML]:
    fake = dgx_like(8)
    nvidia_functions(tmp_path / "sys", fake)
    (tmp_path / "kmsg").write_text(kmsg_line(1, "Linux version 6.1.0") + kmsg_line(2, "nvidia: loading"))
    return tmp_path, fake


def run(tmp: Path, fake: FakeNVML, checks=ALL, state=None, now=None, flags=()) -> Result:
    return check_gpus(fake, values(tmp, *flags), checks, {} if state is None else state, Progress(), now=now)


def test_healthy_node_is_ok(node) -> None:
    tmp, fake = node
    result = run(tmp, fake)
    assert result.status == OK, result.message
    assert result.message.startswith("8 GPUs healthy")
    assert fake.calls[-1] == "shutdown"


def test_gpu_missing_against_the_pci_bus(node) -> None:
    tmp, fake = node
    del fake.gpus[5]  # NVML lost GPU 5; the bus still shows it
    result = run(tmp, fake)
    assert result.status == NONOK
    assert result.message.startswith("7/8 GPUs visible (missing 15:00.0)")


def test_expected_count_from_config_wins(node) -> None:
    tmp, fake = node
    assert run(tmp, fake, flags=("--gpu-expected-count", "9")).message.startswith("8/9 GPUs visible")
    assert run(tmp, fake, flags=("--gpu-expected-count", "8")).status == OK


async def test_expected_count_from_the_node_label(node) -> None:
    tmp, fake = node
    peer = APIServerPeer()
    url = await peer.start()
    try:
        await peer.put_object("api/v1/nodes", {"metadata": {"name": "n1", "labels": {
            "accelstack.io/gpu.expected-count": "10"}}})
        flags = ("--node-name", "n1", "--node-api-server", url)
        state: dict = {}
        result = await _in_thread(lambda: run(tmp, fake, state=state, flags=flags))
        assert result.status == NONOK and result.message.startswith("8/10 GPUs visible"), result.message
        # the label is cached in the state: the API server is not asked again within the cache time
        asked = len(peer.requests)
        await _in_thread(lambda: run(tmp, fake, state=state, flags=flags))
        assert len(peer.requests) == asked
    finally:
        await peer.stop()


async def _in_thread(fn):  # the check uses blocking urllib; the peer needs the event loop
    import asyncio

    return await asyncio.get_running_loop().run_in_executor(None, fn)


def test_unreadable_label_is_unknown_unless_the_bus_proves_a_problem(node) -> None:
    tmp, fake = node
    flags = ("--node-name", "n1", "--node-api-server", "http://127.0.0.1:9")
    result = run(tmp, fake, flags=flags)
    assert result.status == UNKNOWN  # the count the label holds cannot be checked: not OK
    assert result.message.startswith("label accelstack.io/gpu.expected-count unreadable")
    del fake.gpus[5]
    result = run(tmp, fake, flags=flags)
    assert result.status == NONOK and result.message.startswith("7/8 GPUs visible (missing 15:00.0); label")


def test_critical_xid_is_reported_and_held(node) -> None:
    tmp, fake = node
    with (tmp / "kmsg").open("a") as log:
        log.write(xid_line(3, "0000:13:00", 79, "pid=0, GPU has fallen off the bus."))
        log.write(xid_line(4, "0000:11:00", 13))  # graphics exception: application error, ignored
    state: dict = {}
    first = run(tmp, fake, state=state, now=1000.0)
    assert first.status == NONOK
    assert first.message == "GPU3 XID 79: pid=0, GPU has fallen off the bus."
    assert state["kmsg"]["seq"] == 4
    # no new records; still inside the hold time
    assert run(tmp, fake, state=state, now=1000.0 + 299).status == NONOK
    # hold time over: healthy again
    assert run(tmp, fake, state=state, now=1000.0 + 301).status == OK


def test_non_critical_xid_is_a_note_and_empty_critical_list_reports_everything(node) -> None:
    tmp, fake = node
    with (tmp / "kmsg").open("a") as log:
        log.write(xid_line(3, "0000:10:00", 57))
    result = run(tmp, fake, checks=("xid",))
    assert result.status == OK and "GPU0 XID 57 (not critical)" in result.message
    every = run(tmp, fake, checks=("xid",), flags=("--gpu-critical-xids", "", "--gpu-xid-hold-time", "0"))
    assert (every.status, every.message) == (NONOK, "GPU0 XID 57: pid=1234, name=python, Ch 00000008")


def test_xid_storm_keeps_the_state_bounded(node) -> None:
    tmp, fake = node
    with (tmp / "kmsg").open("a") as log:
        for seq in range(3, 503):
            log.write(xid_line(seq, "0000:13:00", 79))
    state: dict = {}
    result = run(tmp, fake, checks=("xid",), state=state)
    assert result.status == NONOK and len(state["recent_xids"]) == 50


def test_only_new_records_count(node) -> None:
    tmp, fake = node
    state = {"kmsg": {"boot": __import__("npd.state").state.boot_id(), "seq": 3}}
    with (tmp / "kmsg").open("a") as log:
        log.write(xid_line(3, "0000:13:00", 79))
    assert run(tmp, fake, checks=("xid",), state=state).status == OK
    state["kmsg"]["boot"] = "another-boot"  # after a reboot the sequence numbers start again
    assert run(tmp, fake, checks=("xid",), state=state).status == NONOK


def test_uncorrected_ecc(node) -> None:
    tmp, fake = node
    fake.gpus[2].ecc_uncorrected = 3
    result = run(tmp, fake)
    assert result.status == NONOK and result.message == "GPU2 12:00.0 3 uncorrected ECC errors"
    assert run(tmp, fake, flags=("--gpu-max-uncorrected-ecc", "3")).status == OK
    fake.gpus[2].ecc_supported = False  # ECC off: no verdict from it
    assert run(tmp, fake).status == OK


@pytest.mark.parametrize(("change", "text"), [
    ({"retired_pending": True}, "retired pages pending"),
    ({"remapped_rows": (0, 1, True, False)}, "row remapping pending"),
    ({"remapped_rows": (0, 9, False, True)}, "row remapping failed"),
])
def test_pages_and_row_remapping(node, change, text) -> None:
    tmp, fake = node
    for key, value in change.items():
        setattr(fake.gpus[1], key, value)
    result = run(tmp, fake)
    assert result.status == NONOK and result.message.startswith("GPU1 11:00.0 " + text)
    assert run(tmp, fake, checks=("count",)).status == OK


def test_pages_not_supported_either_way(node) -> None:
    tmp, fake = node
    for gpu in fake.gpus:
        gpu.retired_supported, gpu.remapped_rows = False, None
    assert run(tmp, fake).status == OK


def test_temperature_against_slowdown_threshold_and_explicit_limit(node) -> None:
    tmp, fake = node
    fake.gpus[4].temperature_c = 86  # slowdown 90 - margin 5 = 85
    assert run(tmp, fake).message == "GPU4 14:00.0 86C over 85C"
    assert run(tmp, fake, flags=("--gpu-temperature-margin", "2")).status == OK
    assert run(tmp, fake, flags=("--gpu-max-temperature", "80")).message == "GPU4 14:00.0 86C over 80C"


def test_power_over_the_enforced_limit(node) -> None:
    tmp, fake = node
    fake.gpus[7].power_mw = 750_000  # limit 700 W, ratio 1.05 -> 735 W
    assert run(tmp, fake).message == "GPU7 17:00.0 750W over 735W"
    assert run(tmp, fake, flags=("--gpu-max-power-ratio", "1.1")).status == OK


def test_nvml_not_initialisable_is_unknown_with_reason(node) -> None:
    tmp, _ = node
    fake = FakeNVML([], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    result = run(tmp, fake)
    assert result.status == UNKNOWN
    assert result.message.startswith("NVML unavailable: Driver Not Loaded")


def test_nvml_failing_yet_xid_in_log_is_nonok(node) -> None:
    tmp, _ = node
    with (tmp / "kmsg").open("a") as log:
        log.write(xid_line(3, "0000:13:00", 79))
    fake = FakeNVML([], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    result = run(tmp, fake)
    assert result.status == NONOK and result.message.startswith("GPU 0000:13:00 XID 79")
    # the kernel-log check alone does not need NVML
    assert run(tmp, fake, checks=("xid",), state={}).status == NONOK


def test_lost_gpu_is_nonok(node) -> None:
    tmp, fake = node
    fake.gpus[6].broken = True
    result = run(tmp, fake)
    assert result.status == NONOK and "GPU is lost" in result.message


def test_hung_nvml_call_answers_unknown_by_the_deadline(node) -> None:
    tmp, fake = node
    release = threading.Event()
    fake.hang["nvmlDeviceGetTemperature"] = release
    vals = values(tmp)
    started = time.monotonic()
    try:
        result = run_with_deadline(lambda p: check_gpus(fake, vals, ALL, {}, p), deadline=0.5)
    finally:
        release.set()
    assert time.monotonic() - started < 1.5
    assert result.status == UNKNOWN
    assert result.message.startswith("no answer within 0.5s (stuck in temperature GPU0 10:00.0")


def test_a_check_that_raises_is_unknown_not_a_traceback() -> None:
    def boom(progress: Progress) -> Result:
        progress("parsing")
        raise KeyError("x")

    result = run_with_deadline(boom, 1.0)
    assert result == Result(UNKNOWN, "check failed in parsing: KeyError: 'x'")


def test_truncation_is_by_bytes_on_character_boundaries() -> None:
    assert truncate("a\nb  c", 80) == "a b c"
    assert truncate("é" * 50, 7) == "ééé"
    assert len(truncate("x" * 200, 80)) == 80


def test_parse_checks() -> None:
    assert parse_checks("count, xid") == ["count", "xid"]
    with pytest.raises(ValueError, match="unknown"):
        parse_checks("count,fans")


@given(st.text(), st.integers(min_value=1, max_value=200))
def test_truncate_properties(message: str, limit: int) -> None:
    cut = truncate(message, limit)
    data = cut.encode()
    assert len(data) <= limit
    assert "\n" not in cut
    assert " ".join(message.split()).startswith(cut)


def test_word_cut_and_fit_examples() -> None:
    assert word_cut("3/4 NR1 modules present (config)", 80) == "3/4 NR1 modules present (config)"
    assert word_cut("label accelstack.io/nr1.expected-count unreadable: refused", 45) == \
        "label accelstack.io/nr1.expected-count…"
    items = ["41:00.0 link down", "42:00.0 health 'fault'", "43:00.0 link down"]
    assert fit("3 NR1 problems: ", items, 60) == "3 NR1 problems: 41:00.0 link down; +2 more"
    assert fit("3 NR1 problems: ", items, 80) == \
        "3 NR1 problems: 41:00.0 link down; 42:00.0 health 'fault'; 43:00.0 link down"


@given(st.lists(st.text(alphabet="abcé :,'", min_size=1, max_size=40), min_size=1, max_size=8),
       st.integers(min_value=30, max_value=120))
def test_fit_properties(items: list[str], limit: int) -> None:
    """Within the limit, on one line; what is shown is the start of the whole message, cut only between words
    (or marked "…" when one word is longer than the room), and "+N more" counts the items left out."""
    items = [" ".join(i.split()) or "x" for i in items]
    head = f"{len(items)} problems: "
    whole = head + "; ".join(items)
    text = fit(head, items, limit)
    assert len(text.encode()) <= limit and "\n" not in text
    body, more = text, 0
    if text.endswith(" more") and text != whole:
        body, _, count = text[:-len(" more")].rpartition("; +")
        more = int(count)
    cut = body.endswith("…")
    body = body.removesuffix("…")
    assert whole.startswith(body)
    rest = whole[len(body):]
    assert not rest or rest[0] in " ;,:(" or body[-1:] in (" ", ";", ",", ":", "(") or cut
    if more:
        shown = body[len(head):].count("; ") + 1
        assert more == len(items) - shown
