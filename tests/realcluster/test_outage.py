"""An API-server outage as the product's processes live it (issue 35.7): while the real kube-apiserver is down,
the extender's and the controller's ``/readyz`` answer 503 (their view is only as current as the outage is long),
each connection refused is logged as one line without a traceback, and both are ready again once it is back."""

from __future__ import annotations

import time

from tests.realcluster.controlplane import ControlPlane, Process
from tests.realcluster.stack import Product, Stack


def _until(what: str, check: object, timeout: float = 90.0) -> None:
    """Poll ``check`` (a callable) until true; the bound only ends a hung run (ordering, not speed, is tested)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.2)
    raise AssertionError(f"not {what} within {timeout:.0f} s")


def _log_since(product: Product, offset: int) -> str:
    return product.log.read_bytes()[offset:].decode(errors="replace")


def test_readyz_is_503_while_the_api_server_is_down_and_refusals_are_one_line(cp: ControlPlane,
                                                                             stack: Stack) -> None:
    ctl = stack.controllers[0]
    products = [stack.extender, ctl]
    _until("ready before the outage", lambda: all(p.status() == 200 for p in products))
    offsets = {p.name: p.log.stat().st_size for p in products}
    cp.procs["kube-apiserver"].stop()
    try:
        # informers resume their watch against a closed port: not healthy, so not ready (was 200 throughout)
        _until("503 on /readyz of the extender and the controller while the API server is down",
               lambda: all(p.status() == 503 for p in products))
        refused = [ln for ln in _log_since(ctl, offsets[ctl.name]).splitlines() if "Connect call failed" in ln]
        assert refused, "the controller logged the refused connection"
    finally:
        cp.procs["kube-apiserver"] = Process("kube-apiserver", cp.apiserver_args, cp.dir / "kube-apiserver.log")
        cp.wait_ready()
    _until("ready again after the API server came back", lambda: all(p.status() == 200 for p in products))
    # the binder Lease could not be renewed during the outage: the extender stopped binding, and binds again once
    # it holds the Lease and has read the pods afresh (the tests after this one bind)
    stack.wait_binding()
    for p in products:
        text = _log_since(p, offsets[p.name])
        # a refused connection is an expected outage, not a bug: one line each, never a traceback
        assert "Traceback" not in text, f"{p.name} logged a traceback during the outage:\n{text[-3000:]}"
        assert "recovered" in text, f"{p.name} did not log its recovery:\n{text[-2000:]}"
