"""The operator documentation stays true to the code and the manifests.

- docs/configuration.md: the generated tables equal what ``scripts/gen_config_docs.py`` prints from the code,
  and the CNI key table names exactly the keys ``cni/config.py`` reads.
- The example workloads in manifests/examples that are not Pods or Jobs (those are checked by
  tests/extender/test_crds.py): the inference Deployment links to a GPR of the examples that holds its
  autoscaler's maximum, and the autoscaler targets it.
- Relative links between the docs point at files that exist.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
EXAMPLES = ROOT / "manifests" / "examples"
OPERATOR_DOCS = ("architecture.md", "install.md", "configuration.md", "troubleshooting.md", "tour.md")


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
