"""The operator documentation stays true to the code and the manifests.

- docs/configuration.md: the generated tables equal what ``scripts/gen_config_docs.py`` prints from the code,
  and the CNI key table names exactly the keys ``cni/config.py`` reads.
- The example workloads in manifests/examples that are not Pods or Jobs (those are checked by
  tests/extender/test_crds.py): the inference Deployment links to a GPR of the examples that holds its
  autoscaler's maximum, and the autoscaler targets it.
- Relative links between the docs point at files that exist.
- What the docs state about the code and the manifests, where a test can read it: the sample tables of
  ``kubectl get`` (``-o wide`` too) have the CRD's printer columns; the number of Prometheus Operator objects
  install.md and the README count is what the overlays render; the queue order and the estimates are described as
  the core's default works (no "priority, then age", no "running GPRs end at their exitDuration"); every ``*.md``
  a doc names exists (no UPSTREAM.md outside the repository); no "issue N" without a link to it.
- The README's headline figures are figures of docs/performance.md, each with a command and a dated run.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from tests.realcluster.shipped import render

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
EXAMPLES = ROOT / "manifests" / "examples"
OPERATOR_DOCS = ("architecture.md", "install.md", "configuration.md", "troubleshooting.md", "tour.md")
ALL_DOCS = (ROOT / "README.md", *sorted(DOCS.glob("*.md")))


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gen_config_docs", module)
    spec.loader.exec_module(module)
    return module


def test_generated_configuration_tables_match_the_code() -> None:
    gen = generator()
    text = (DOCS / "configuration.md").read_text()
    found = gen.found_blocks(text)
    expected = gen.blocks()
    assert set(found) == set(expected), f"blocks in docs/configuration.md: {sorted(found)}, expected {sorted(expected)}"
    for name, body in expected.items():
        assert found[name] == gen.render(name, body), (
            f"docs/configuration.md block {name!r} is stale: run "
            "`python scripts/gen_config_docs.py --write docs/configuration.md`")


def test_generator_describes_every_option_type() -> None:
    gen = generator()
    from device_plugin.config import OPTIONS as DP
    from npd.config import OPTIONS as NPD

    options: list[Any] = [*DP, *NPD]
    for option in options:
        kind = gen.describe_type(option.parse)
        assert kind and "parse" not in kind, (option.key, kind)  # a parser the generator does not know


def test_cni_key_table_lists_exactly_the_keys_the_plugin_reads() -> None:
    source = (ROOT / "cni" / "config.py").read_text()
    read = set(re.findall(r'_field\(conf, "(\w+)"', source))
    read |= {k for k in ("ipam", "dns", "deviceID") if f'"{k}"' in source}
    text = (DOCS / "configuration.md").read_text()
    section = text.split("## accelstack-nr1-cni", 1)[1]
    table_keys = set(re.findall(r"^\| `([\w.]+)`", section, re.MULTILINE))
    table_keys |= set(re.findall(r"^\| `[\w.]+`, `([\w.]+)`", section, re.MULTILINE))
    assert read <= table_keys, f"not documented: {sorted(read - table_keys)}"
    assert table_keys - read <= {"runtimeConfig.deviceID"}, f"documented but not read: {sorted(table_keys - read)}"


def _docs(kind: str) -> list[dict[str, Any]]:
    found = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        found += [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == kind]
    return found


def test_inference_deployment_has_a_gpr_sized_for_its_autoscaler() -> None:
    gprs = {(g["metadata"]["namespace"], g["metadata"]["name"]): g for g in _docs("GPUProvisioningRequest")}
    deployments = {(d["metadata"]["namespace"], d["metadata"]["name"]): d for d in _docs("Deployment")}
    hpas = _docs("HorizontalPodAutoscaler")
    assert deployments and hpas
    for hpa in hpas:
        ref = hpa["spec"]["scaleTargetRef"]
        assert (ref["apiVersion"], ref["kind"]) == ("apps/v1", "Deployment")
        deployment = deployments[(hpa["metadata"]["namespace"], ref["name"])]
        template = deployment["spec"]["template"]
        assert template["spec"]["schedulerName"] == "accelstack-scheduler"
        gpr = gprs[(deployment["metadata"]["namespace"], template["metadata"]["labels"]["accelstack.io/gpr"])]
        spec = gpr["spec"]
        resource = spec.get("resource", "nvidia.com/gpu")
        per_pod = sum(int((c.get("resources", {}).get("limits") or {}).get(resource, 0))
                      for c in template["spec"]["containers"])
        assert 1 <= per_pod <= spec.get("devicesPerNode", 1)
        reserved = spec.get("devicesPerNode", 1) * spec.get("nodeCount", 1)
        assert reserved >= per_pod * hpa["spec"]["maxReplicas"], "the GPR must hold the autoscaler's maximum"
        assert spec.get("devicesPerNode", 1) % per_pod == 0, "whole pods per node"
        assert deployment["spec"]["replicas"] <= hpa["spec"]["maxReplicas"]


def test_nr1_example_pod_names_the_example_network() -> None:
    nad_file = ROOT / "manifests" / "cni" / "networkattachmentdefinition-example.yaml"
    nads = [d for d in yaml.safe_load_all(nad_file.read_text()) if d and d["kind"] == "NetworkAttachmentDefinition"]
    names = {(n["metadata"]["namespace"], n["metadata"]["name"]) for n in nads}
    pods = [p for p in yaml.safe_load_all((EXAMPLES / "nr1-pod.yaml").read_text()) if p and p["kind"] == "Pod"]
    assert pods
    for pod in pods:
        networks = pod["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"]
        for item in networks.split(","):
            ref = item.strip().split("@", 1)[0]
            namespace, _, name = ref.rpartition("/")
            assert (namespace or pod["metadata"]["namespace"], name) in names, item
        limits = pod["spec"]["containers"][0]["resources"]["limits"]
        assert int(limits["neureality.com/nr1"]) >= 1


def test_relative_links_in_the_operator_docs_resolve() -> None:
    for name in OPERATOR_DOCS:
        text = (DOCS / name).read_text()
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" in target:
                continue
            assert (DOCS / target).resolve().exists(), f"docs/{name} links to {target}, which does not exist"


PATH_PREFIXES = ("manifests/", "docs/", "scripts/", "tests/", "device_plugin/", "scheduler_extender/", "npd/", "cni/",
                 "bench/", "protos/")


def test_repository_paths_and_test_names_cited_in_the_operator_docs_exist() -> None:
    all_tests = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py"))
    for name in OPERATOR_DOCS:
        text = (DOCS / name).read_text()
        for token in re.findall(r"`([^`\s]+)`", text):
            path, _, test = token.partition("::")
            if path.startswith(PATH_PREFIXES) and "<" not in path and "*" not in path:
                target = ROOT / path.rstrip("/")
                assert target.exists(), f"docs/{name} cites {path}, which does not exist"
                if test:
                    assert re.search(rf"def {re.escape(test)}\(", target.read_text()), f"docs/{name}: no {token}"
            elif re.fullmatch(r"test_\w+", token):
                assert re.search(rf"def {token}\(", all_tests), f"docs/{name} cites {token}, which is no test"


def crd_columns() -> dict[str, tuple[list[str], list[str]]]:
    """Each name kubectl knows a CRD by -> the header of ``kubectl get`` and of ``kubectl get -o wide``."""
    found: dict[str, tuple[list[str], list[str]]] = {}
    for path in sorted((ROOT / "manifests" / "crds").glob("*.yaml")):
        for crd in yaml.safe_load_all(path.read_text()):
            if not crd or crd.get("kind") != "CustomResourceDefinition":
                continue
            names = crd["spec"]["names"]
            (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
            columns = version.get("additionalPrinterColumns", [])
            plain = ["NAME", *(c["name"].upper() for c in columns if not c.get("priority"))]
            wide = ["NAME", *(c["name"].upper() for c in columns)]
            for name in (names["plural"], names["singular"], names["kind"].lower(), *names.get("shortNames", []),
                         f"{names['plural']}.{crd['spec']['group']}"):
                found[name] = (plain, wide)
    return found


def get_samples() -> list[tuple[str, int, list[str], list[str]]]:
    """(doc, line, the ``kubectl get`` words, the lines printed) of each ``$ kubectl get <CRD>`` in a console
    block that prints a table (no ``-o`` other than ``wide``)."""
    known = crd_columns()
    found = []
    for path in ALL_DOCS:
        lines = path.read_text().splitlines()
        inside = False
        for number, line in enumerate(lines):
            if line.strip().startswith("```"):
                inside = line.strip() == "```console"
                continue
            if not inside or not line.startswith("$ kubectl get "):
                continue
            words = line[2:].split()
            resource = words[2].split("/")[0]
            output = [words[i + 1] for i, w in enumerate(words[:-1]) if w == "-o"]
            if resource not in known or any(o != "wide" for o in output):
                continue
            printed = []
            for row in lines[number + 1:]:
                if not row.strip() or row.startswith(("$", "```")):
                    break
                printed.append(row)
            found.append((path.name, number + 1, words, printed))
    return found


def test_kubectl_get_samples_have_the_printer_columns_of_the_crd() -> None:
    samples = get_samples()
    assert any("wide" in words for _d, _n, words, _p in samples), "no `kubectl get -o wide` sample found"
    known = crd_columns()
    for doc, number, words, printed in samples:
        plain, wide = known[words[2].split("/")[0]]
        expected = wide if "wide" in words else plain
        if "-A" in words or "--all-namespaces" in words:
            expected = ["NAMESPACE", *expected]
        header = printed[0]
        assert re.split(r"\s{2,}", header.strip()) == expected, f"docs/{doc}:{number}: {' '.join(words)}"
        starts = {m.start() for m in re.finditer(r"\S+(?: \S+)*", header)}
        for row in printed[1:]:  # every value starts under a column's name, empty cells included
            cells = {m.start() for m in re.finditer(r"(?<!\S)\S+", row)}
            assert cells <= starts, f"docs/{doc}:{number}: a value is not under its column: {row!r}"


NUMBER_WORDS = {w: n for n, w in enumerate(("zero", "one", "two", "three", "four", "five", "six", "seven", "eight",
                                             "nine", "ten"))}


def rendered_monitoring(overlay: str) -> Counter[str]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is missing (scripts/system-deps.sh installs Debian's kubernetes-client as root)")
    return Counter(o["kind"] for o in render(f"manifests/{overlay}")
                   if o["apiVersion"].startswith("monitoring.coreos.com/"))


def counted(text: str, pattern: str, where: str) -> int:
    match = re.search(pattern, text)
    assert match is not None, f"{where} no longer says {pattern!r}: update this test with the text"
    return NUMBER_WORDS[match.group(1)]


def test_prometheus_operator_objects_the_docs_count_are_the_ones_rendered() -> None:
    """install.md and the README say how many objects fail to apply without the operator's CRDs."""
    install = (DOCS / "install.md").read_text()
    readme = re.sub(r"\s+", " ", (ROOT / "README.md").read_text())
    rendered = {overlay: rendered_monitoring(overlay) for overlay in ("base", "overlays/gpu", "overlays/nr1",
                                                                      "overlays/full")}
    for overlay, kinds in rendered.items():
        total = sum(kinds.values())
        assert counted(install, r"the apply fails on those (\w+) objects", "docs/install.md") == total, (overlay, kinds)
        assert counted(install, r"renders (\w+) objects of the operator's kinds", "docs/install.md") == total
        assert counted(readme, r"delete the (\w+) objects of their kinds", "README.md") == total, (overlay, kinds)
        assert counted(install, r"(\w+) `PodMonitor`s", "docs/install.md") == kinds["PodMonitor"], (overlay, kinds)


STALE_CLAIMS = (
    r"priority(,| first,) then age",  # the default order is priority level, then predicted size with ageing
    r"end at (their|its) `?exitDuration",  # estimates project predicted durations, not end bounds
    r"ServiceMonitor scrapes only the exporters",  # PodMonitors ship for the other processes
    r"add your own (Service|Pod)Monitor",
)


def test_docs_describe_the_queue_and_estimates_as_the_core_works() -> None:
    from scheduler_extender.core.scheduler import SchedulerConfig

    assert SchedulerConfig().order == "size", "the docs describe the size order with ageing as the default"
    for path in ALL_DOCS:
        text = re.sub(r"\s+", " ", path.read_text())
        for claim in STALE_CLAIMS:
            match = re.search(claim, text, re.IGNORECASE)
            assert match is None, f"{path.name} says {match.group(0)!r}, which the code no longer does"
    for name in ("tour.md", "architecture.md"):
        text = re.sub(r"\s+", " ", (DOCS / name).read_text())
        assert "predicted" in text and "ageing" in text and "calibrat" in text, name


def test_markdown_files_the_docs_name_exist() -> None:
    """A doc that names ``UPSTREAM.md`` (or any ``*.md``) names a file of this repository, or links to it."""
    for path in ALL_DOCS:
        text = re.sub(r"https?://[^\s)>]+", "", path.read_text())
        for name in re.findall(r"[\w./-]*\w\.md\b", text):
            assert (path.parent / name).exists() or (ROOT / name).exists(), \
                f"{path.relative_to(ROOT)} names {name}, which is not in the repository"


def test_relative_links_in_every_doc_resolve() -> None:
    for path in ALL_DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" not in target and not target.startswith("mailto:"):
                assert (path.parent / target).resolve().exists(), f"{path.name} links to {target}, which does not exist"


# Still citing issue numbers of this project's own tracker, and being edited elsewhere at the time of writing.
ISSUE_NUMBERS_PENDING: set[str] = set()


def test_no_doc_cites_an_issue_number_without_a_link() -> None:
    """'issue 12' means nothing to a reader who has no tracker to look it up in: a doc says what it means (a
    commit, a date, a section) or links to the issue."""
    for path in ALL_DOCS:
        if path.name in ISSUE_NUMBERS_PENDING:
            continue
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            for match in re.finditer(r"\bissues? \d+", line, re.IGNORECASE):
                linked = re.search(r"\[[^\]]*" + re.escape(match.group(0)) + r"[^\]]*\]\(https?://", line)
                assert linked, f"{path.name}:{number}: {match.group(0)!r} without a link"


def test_headline_figures_are_rows_of_the_performance_page() -> None:
    """The README's headline table repeats figures of docs/performance.md, each with a command and its run."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Headline figures", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines()
            if line.startswith("|") and not line.startswith("|---")]
    header, *rows = rows
    assert header == ["what", "figure", "against", "command", "measured"]
    assert 5 <= len(rows) <= 8
    performance = (DOCS / "performance.md").read_text()
    for what, figure, _against, command, measured in rows:
        for number in re.findall(r"\d[\d,.]*", figure):
            assert number in performance, f"headline {what!r}: {number} is not in docs/performance.md"
        assert command == "same" or command.startswith("`"), what
        assert re.search(r"20\d\d-\d\d-\d\d, (before )?`[0-9a-f]{7,}`", measured), what
