"""``kubectl-accelstack`` against the real REST server (the API-server peer behind it): tables, -o json|yaml,
the token from flags, environment or kubeconfig, and errors (bad arguments exit 2, API errors exit 1 with one
line)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from scheduler_extender.cli.kubectl_plugin import kubeconfig_token, main
from tests.portal.test_rest_views import seeded


async def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = await asyncio.to_thread(main, list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def lines(text: str) -> list[list[str]]:
    return [line.split() for line in text.strip().splitlines()]


async def test_queue_inventory_and_workspace_tables(capsys: pytest.CaptureFixture[str]) -> None:
    async with seeded() as (_, base, _http):
        auth = ("--server", base, "--token", "admin-token")
        code, out, err = await run(capsys, *auth, "queue")
        assert code == 0, err
        table_part, _, order = out.partition("\n\n")
        rows = lines(table_part)
        assert rows[0][:5] == ["POS", "NAMESPACE", "NAME", "WORKSPACE", "PHASE"]
        assert [r[2] for r in rows[1:]] == ["finetune", "batch", "sweep", "train-big", "exp"]
        assert rows[1][:7] == ["1", "team-a", "finetune", "team-a", "Queued", "120", "(medium)"] and "in" in rows[1]
        # under the table, how the queue is ordered (issue 35.4: the position alone explained nothing)
        assert " ".join(order.split()).startswith("Queued GPRs start by priority level, strictly: high (201-300)")
        code, out, _ = await run(capsys, *auth, "queue", "-w", "team-a", "--phase", "Queued")
        assert [r[2] for r in lines(out.partition("\n\n")[0])[1:]] == ["finetune"]

        code, out, _ = await run(capsys, *auth, "inventory")
        assert code == 0 and "NODE.KUBERNETES.IO/INSTANCE-TYPE" in out and "6 nodes, 36 devices: 0 allocated, 10 reserved, 17 free" in out
        h100 = next(r for r in lines(out) if "p5.48xlarge" in r)
        assert h100 == ["nvidia.com/gpu", "NVIDIA-H100-80GB-HBM3", "p5.48xlarge", "3", "24", "0", "10", "6", "1"]
        code, out, _ = await run(capsys, *auth, "inventory", "--group", "g5.12xlarge")
        assert [r[0] for r in lines(out)[1:]] == ["g5-0", "g5-1"]
        code, out, _ = await run(capsys, *auth, "inventory", "--node", "p5-0")
        assert "Node:   p5-0" in out and "team-a/train-big" in out

        code, out, _ = await run(capsys, *auth, "workspace", "usage")
        assert lines(out)[1] == ["team-a", "nvidia.com/gpu", "any", "8", "2", "8", "16", "63%", "1/1/1"]


async def test_gpr_describe_says_why_it_waits(capsys: pytest.CaptureFixture[str]) -> None:
    async with seeded() as (_, base, _http):
        code, out, err = await run(capsys, "--server", base, "--token", "admin-token", "gpr", "describe",
                                   "team-a/finetune")
        assert code == 0, err
        assert "Phase:        Queued (InsufficientCapacity)" in out and "Position:     1" in out
        assert "Why it waits: InsufficientCapacity: needs 8 free nvidia.com/gpu on one node; p5-0 holds " \
               "train-big" in out
        assert "Request:      8 x nvidia.com/gpu on 1 node(s), priority 120" in out
        assert "position 1; estimated start in 15m" in out  # its Event
        code, out, _ = await run(capsys, "--server", base, "--token", "admin-token", "gpr", "describe",
                                 "team-a/train-big")
        assert "Reservation:  p5-0 (8)" in out and "Why it waits" not in out
        code, out, _ = await run(capsys, "--server", base, "--token", "bob-token", "gpr", "describe",
                                 "team-b/batch", "-o", "json")
        data = json.loads(out)
        assert code == 0 and data["gpr"]["status"]["queuePosition"] == 2 and data["events"][0]["reason"] == "Queued"


async def test_wait_time_from_a_template_and_outputs(capsys: pytest.CaptureFixture[str]) -> None:
    async with seeded() as (_, base, _http):
        auth = ("--server", base, "--token", "admin-token")
        code, out, err = await run(capsys, *auth, "wait-time", "-n", "team-a", "--template", "small-gpu")
        assert code == 0, err
        assert "Queue position:  3" in out and "Estimated start: in 30m" in out and "after the GPRs ahead" in out
        code, out, _ = await run(capsys, *auth, "wait-time", "-n", "team-a", "--devices", "1", "--priority", "200",
                                 "-o", "yaml")
        data = yaml.safe_load(out)
        assert data["queuePosition"] == 1 and data["estimable"] is True and data["basis"] == "fits now"
        code, out, _ = await run(capsys, *auth, "-o", "json", "workspace", "usage", "team-a")
        assert json.loads(out)[0]["status"]["usage"][0]["max"] == 16


async def test_token_from_the_environment_or_kubeconfig(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    config: dict[str, Any] = {
        "apiVersion": "v1", "kind": "Config", "current-context": "ops",
        "contexts": [{"name": "other", "context": {"user": "nobody"}}, {"name": "ops", "context": {"user": "alice"}}],
        "users": [{"name": "nobody", "user": {"token": "wrong"}}, {"name": "alice", "user": {"token": "admin-token"}}]}
    path = tmp_path / "config"
    path.write_text(yaml.safe_dump(config))
    assert kubeconfig_token(str(path)) == "admin-token"
    (tmp_path / "token").write_text("file-token\n")
    config["users"][1]["user"] = {"tokenFile": str(tmp_path / "token")}
    path.write_text(yaml.safe_dump(config))
    assert kubeconfig_token(str(path)) == "file-token"
    assert kubeconfig_token(str(tmp_path / "missing")) == ""
    async with seeded() as (_, base, _http):
        monkeypatch.setenv("ACCELSTACK_SERVER", base)
        monkeypatch.setenv("KUBECONFIG", str(path))
        monkeypatch.delenv("ACCELSTACK_TOKEN", raising=False)
        config["users"][1]["user"] = {"token": "admin-token"}
        path.write_text(yaml.safe_dump(config))
        code, out, err = await run(capsys, "queue", "-n", "team-b")
        assert code == 0 and "batch" in out, err
        monkeypatch.setenv("ACCELSTACK_TOKEN", "carol-token")
        code, out, err = await run(capsys, "queue", "-n", "team-b")
        assert code == 1 and out == ""
        assert err.strip() == ("kubectl-accelstack: error: GET /api/v1/queue: 403 carol may not list "
                               "gpuprovisioningrequests in namespace team-b: no RBAC rule allows it")


async def test_errors_are_one_line_with_the_right_exit_code(capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ACCELSTACK_SERVER", raising=False)
    monkeypatch.delenv("ACCELSTACK_TOKEN", raising=False)
    monkeypatch.setenv("KUBECONFIG", "/nonexistent")
    code, _, err = await run(capsys, "queue")
    assert code == 2 and "no server: give --server or set ACCELSTACK_SERVER" in err
    code, _, err = await run(capsys, "--server", "ftp://x", "queue")
    assert code == 2 and "--server: want an http:// or https:// URL" in err
    with pytest.raises(SystemExit) as exit_:
        main(["--server", "http://x", "queue", "--limit", "0"])
    assert exit_.value.code == 2 and "want a number of at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["frobnicate"])
    assert exit_.value.code == 2 and "invalid choice: 'frobnicate'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["--server", "http://x", "queue", "-o", "xml"])
    assert exit_.value.code == 2 and "invalid choice: 'xml'" in capsys.readouterr().err
    code, _, err = await run(capsys, "--server", "http://x", "gpr", "describe", "just-a-name")
    assert code == 2 and "want NAMESPACE/NAME, got 'just-a-name'" in err
    code, _, err = await run(capsys, "--server", "http://127.0.0.1:9", "queue")
    assert code == 1 and err.startswith("kubectl-accelstack: error: cannot reach the accelstack REST API at "
                                        "http://127.0.0.1:9") and err.count("\n") == 1
    async with seeded() as (_, base, _http):
        code, _, err = await run(capsys, "--server", base, "queue")
        assert code == 1 and "401 a bearer token is required" in err and "give --token" in err
        code, _, err = await run(capsys, "--server", base, "--token", "admin-token", "gpr", "describe", "team-a/nope")
        assert code == 1 and "404" in err and err.count("\n") == 1
        assert err.count("404") == 1 and "NotFound" not in err and '"nope" not found' in err, err
        code, _, err = await run(capsys, "--server", base, "--token", "admin-token", "queue", "--phase", "Zzz")
        assert code == 1 and "400 phase: unknown 'Zzz'" in err


def test_help_reads_well(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    for word in ("queue", "inventory", "wait-time", "gpr", "workspace", "ACCELSTACK_SERVER", "examples:"):
        assert word in out
    with pytest.raises(SystemExit):
        main(["gpr", "describe", "--help"])
    assert "NAMESPACE/NAME" in capsys.readouterr().out
