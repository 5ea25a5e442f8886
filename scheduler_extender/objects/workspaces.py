"""Workspaces as pure functions: API objects in, the namespaces, RBAC objects, quotas and status they imply out.

A ``Workspace`` (cluster-scoped, ``accelstack.io/v1alpha1``) lists namespaces, access rules (subjects -> admin,
member or viewer), a GPR policy and a default template. From the objects the informers hold, :func:`plan` derives
(level-triggered: nothing depends on memory of earlier passes)

- the namespaces to create (labelled ``accelstack.io/workspace=<name>``, annotated as created by the workspace) or
  adopt (an existing namespace only gets the label), and the labels to take off namespaces a workspace let go —
  **a namespace is never deleted**, created or adopted: it may hold work the workspace never knew of;
- per namespace, a Role per role (``accelstack-workspace-<role>``) with the rules of the role templates
  (ConfigMap ``accelstack-workspace-roles``, keys ``admin``, ``member``, ``viewer``: YAML lists of PolicyRules;
  a key left out gets the built-in default), a RoleBinding per role that has subjects, and the ServiceAccounts the
  rules name that belong in that namespace;
- the deletion of every object carrying :data:`MANAGED_LABEL` that no workspace wants any more (a rule removed, a
  namespace dropped, the workspace deleted) — exactly what was created, nothing else: a ServiceAccount or Role that
  existed before (without the label) is left alone;
- the status of each workspace, written only when it differs.

Membership: a namespace belongs to the workspace that lists it; when two list it (the admission webhook refuses
the second, so only when it was bypassed), the one the namespace's label names keeps it, else the oldest. A
namespace in no workspace is its own workspace, as before workspaces existed.

Quotas (:func:`quotas`): the policy core has one quota per workspace, in device milli. A workspace's
``policy.devices`` entries without a model are enforced there per resource: a GPR's core workspace is
``<workspace>|<resource>`` (:func:`core_workspace`), so a GPU quota never blocks NR1 requests and an NR1 quota
never counts GPUs. Entries with a model are the core's model caps (:func:`model_caps`), under the same key: the
core places a GPR on a capped model only while the workspace's devices of that model plus the whole GPR stay
within the cap (other models stay open to it). A single GPR that could only ever run on capped models and asks for
more than their caps is refused by the admission webhook.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from scheduler_extender.objects import gpr_codec as gr
from scheduler_extender.objects.conditions import status_differs

GROUP, VERSION = "accelstack.io", "v1alpha1"
WORKSPACE_KIND, WORKSPACE_PLURAL = "Workspace", "workspaces"
BINDING_KIND, BINDING_PLURAL = "GPRTemplateBinding", "gprtemplatebindings"
WORKSPACE_LABEL = "accelstack.io/workspace"  # on namespaces: membership; on created objects: whose they are
MANAGED_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "accelstack-workspace-controller"
MANAGED_SELECTOR = f"{MANAGED_LABEL}={MANAGED_BY}"
CREATED_ANNOTATION = "accelstack.io/created-by-workspace"  # on namespaces the controller created
ROLE_TEMPLATES = "accelstack-workspace-roles"  # ConfigMap in the controller's namespace
ROLES = ("admin", "member", "viewer")
SUBJECT_KINDS = ("User", "Group", "ServiceAccount")
RBAC_GROUP = "rbac.authorization.k8s.io"
ROLE_PREFIX = "accelstack-workspace-"
MAX_RULES = 64

_READ = ["get", "list", "watch"]
_WRITE = ["create", "update", "patch", "delete"]
# The built-in role templates. The controller can only create Roles granting what it holds itself (it has no
# RBAC 'escalate'), so its ClusterRole (manifests/extender/rbac.yaml) carries exactly these rules: a template that
# grants more makes the Role's creation fail with 403, shown on the Workspace (condition Ready, reason Forbidden).
DEFAULT_TEMPLATES: dict[str, list[dict[str, Any]]] = {
    "viewer": [
        {"apiGroups": [GROUP], "resources": ["gpuprovisioningrequests", "gprtemplates", BINDING_PLURAL],
         "verbs": _READ},
        {"apiGroups": [""], "resources": ["pods", "events"], "verbs": _READ},
    ],
    "member": [
        {"apiGroups": [GROUP], "resources": ["gpuprovisioningrequests"], "verbs": _READ + _WRITE},
        {"apiGroups": [GROUP], "resources": ["gprtemplates", BINDING_PLURAL], "verbs": _READ},
        {"apiGroups": [""], "resources": ["pods", "events"], "verbs": _READ},
        {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
    ],
    "admin": [
        {"apiGroups": [GROUP], "resources": ["gpuprovisioningrequests", "gprtemplates", BINDING_PLURAL],
         "verbs": _READ + _WRITE},
        {"apiGroups": [""], "resources": ["pods", "events"], "verbs": _READ},
        {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
    ],
}


class PolicyError(ValueError):
    """A role template or workspace field the controller cannot use (the message names it)."""


# ---- reading the objects -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Subject:
    kind: str
    name: str
    namespace: str  # ServiceAccount only; "" = the namespace being bound
    role: str


@dataclass(frozen=True)
class DeviceQuota:
    resource: str
    model: str  # "" = every model of the resource
    max: int
    shared_max: int | None = None  # a hub workspace's copy: the limit across its clusters (``max`` is the share)

    @property
    def limit(self) -> int:
        """The most the workspace may ever hold (what admission checks a GPR against)."""
        return self.max if self.shared_max is None else max(self.max, self.shared_max)


@dataclass(frozen=True)
class Policy:
    priority_range: tuple[int, int] | None = None
    max_gprs: int | None = None
    devices: tuple[DeviceQuota, ...] = ()
    max_exit_s: float | None = None
    max_idle_s: float | None = None


@dataclass(frozen=True)
class Workspace:
    name: str
    uid: str
    created: str
    generation: int
    namespaces: tuple[str, ...]
    access: tuple[Subject, ...]
    policy: Policy
    default_template: tuple[str, str] | None
    status: Mapping[str, Any]
    error: str = ""  # a spec the schema should have refused (the webhook/CRD were bypassed)


def _map(value: Any) -> Mapping[str, Any]:
    if type(value) is dict:  # what the informers hold; the generic test below is slow on a hot path
        return value
    return value if isinstance(value, Mapping) else {}


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _duration(spec: Mapping[str, Any], key: str) -> float | None:
    raw = spec.get(key)
    if raw is None:
        return None
    try:
        return gr.parse_duration(raw)
    except gr.SpecError:
        raise PolicyError(f"spec.policy.{key}: {raw!r} is not a duration such as 24h or 90m") from None


def parse_policy(raw: Any) -> Policy:
    """``spec.policy`` (:class:`PolicyError` naming the field when it is unusable)."""
    if raw is None:
        return Policy()
    if not isinstance(raw, Mapping):
        raise PolicyError("spec.policy: must be an object")
    rng = raw.get("priorityRange")
    prange = None
    if rng is not None:
        lo, hi = (rng.get("min"), rng.get("max")) if isinstance(rng, Mapping) else (None, None)
        if not (isinstance(lo, int) and isinstance(hi, int)) or lo > hi:
            raise PolicyError(f"spec.policy.priorityRange: want {{min, max}} with min <= max, got {rng!r}")
        prange = (lo, hi)
    max_gprs = raw.get("maxGPRs")
    if max_gprs is not None and (not isinstance(max_gprs, int) or isinstance(max_gprs, bool) or max_gprs < 1):
        raise PolicyError(f"spec.policy.maxGPRs: want a whole number >= 1, got {max_gprs!r}")
    devices = []
    raw_devices = raw.get("devices")
    if raw_devices is not None and not isinstance(raw_devices, list):  # (a number here was a TypeError, a 500)
        raise PolicyError("spec.policy.devices: want a list of {resource, model (optional), max >= 0}, got "
                          f"{str(raw_devices)[:80]!r}")
    for i, d in enumerate(raw_devices or ()):
        if not isinstance(d, Mapping) or not isinstance(d.get("resource"), str) \
                or not isinstance(d.get("max"), int) or isinstance(d["max"], bool) or d["max"] < 0 \
                or (d.get("model") is not None and not isinstance(d["model"], str)):
            raise PolicyError(f"spec.policy.devices[{i}]: want {{resource, model (optional), max >= 0}}, got "
                              f"{repr(d)[:120]}")
        shared = d.get("sharedMax")
        if shared is not None and (not isinstance(shared, int) or isinstance(shared, bool) or shared < 0):
            raise PolicyError(f"spec.policy.devices[{i}].sharedMax: want a whole number >= 0, got {shared!r}")
        devices.append(DeviceQuota(d["resource"], _str(d.get("model")), d["max"], shared))
    if len({(d.resource, d.model) for d in devices}) != len(devices):
        raise PolicyError("spec.policy.devices: one entry per resource and model")
    return Policy(prange, max_gprs, tuple(devices), _duration(raw, "maxExitDuration"),
                  _duration(raw, "maxIdleTimeout"))


def parse_workspace(obj: Mapping[str, Any]) -> Workspace:
    meta = obj.get("metadata") or {}
    spec, status = _map(obj.get("spec")), _map(obj.get("status"))
    name, error = _str(meta.get("name")), ""
    namespaces = tuple(dict.fromkeys(n for n in spec.get("namespaces") or () if isinstance(n, str) and n))
    access = []
    for rule in spec.get("access") or ():
        if not isinstance(rule, Mapping) or rule.get("kind") not in SUBJECT_KINDS or rule.get("role") not in ROLES \
                or not _str(rule.get("name")):
            error = f"spec.access: {rule!r} is not {{kind: User|Group|ServiceAccount, name, role: admin|member|viewer}}"
            continue
        ns = _str(rule.get("namespace")) if rule["kind"] == "ServiceAccount" else ""
        access.append(Subject(rule["kind"], rule["name"], ns, rule["role"]))
    try:
        policy = parse_policy(spec.get("policy"))
    except PolicyError as exc:
        policy, error = Policy(), str(exc)
    tpl = spec.get("defaultTemplate")
    default = (tpl["namespace"], tpl["name"]) if isinstance(tpl, Mapping) and _str(tpl.get("namespace")) \
        and _str(tpl.get("name")) else None
    generation = _int(meta.get("generation"), 0)
    return Workspace(name, _str(meta.get("uid")), _str(meta.get("creationTimestamp")), generation, namespaces,
                     tuple(dict.fromkeys(access)), policy, default, status, error)


def parse_templates(configmap: Mapping[str, Any] | None) -> tuple[dict[str, list[dict[str, Any]]], dict[str, str]]:
    """The role templates: (role -> PolicyRules, role -> why its template is unusable). A role without a key in
    the ConfigMap (or without the ConfigMap) gets :data:`DEFAULT_TEMPLATES`; an unusable one gets no rules and
    the controller leaves that role's Roles as they are until it is fixed."""
    data = (configmap or {}).get("data") or {}
    rules: dict[str, list[dict[str, Any]]] = {}
    errors: dict[str, str] = {}
    for role in ROLES:
        if role not in data:
            rules[role] = [dict(r) for r in DEFAULT_TEMPLATES[role]]
            continue
        try:
            rules[role] = check_rules(yaml.safe_load(data[role]), f"ConfigMap {ROLE_TEMPLATES} key {role}")
        except (yaml.YAMLError, PolicyError) as exc:
            errors[role] = str(exc).splitlines()[0][:300] if isinstance(exc, PolicyError) else (
                f"ConfigMap {ROLE_TEMPLATES} key {role}: not YAML: {str(exc).splitlines()[0][:200]}")
    return rules, errors


def check_rules(value: Any, where: str) -> list[dict[str, Any]]:
    """A list of RBAC PolicyRules (apiGroups, resources, verbs, resourceNames); :class:`PolicyError` otherwise."""
    if not isinstance(value, list) or len(value) > MAX_RULES:
        raise PolicyError(f"{where}: want a list of at most {MAX_RULES} RBAC rules "
                          "({apiGroups, resources, verbs[, resourceNames]})")
    out = []
    for i, rule in enumerate(value):
        if not isinstance(rule, dict) or set(rule) - {"apiGroups", "resources", "verbs", "resourceNames"}:
            raise PolicyError(f"{where}[{i}]: want apiGroups, resources, verbs and optionally resourceNames")
        for key in ("apiGroups", "resources", "verbs", "resourceNames"):
            items = rule.get(key, [] if key == "resourceNames" else None)
            if not isinstance(items, list) or not all(isinstance(s, str) for s in items) \
                    or (key != "resourceNames" and key != "apiGroups" and not items):
                raise PolicyError(f"{where}[{i}].{key}: want a list of strings")
        out.append({k: list(rule[k]) for k in ("apiGroups", "resources", "resourceNames", "verbs") if k in rule})
    return out


# ---- membership and quotas -----------------------------------------------------------------------------------
def membership(workspaces: Iterable[Workspace], namespace_labels: Mapping[str, Mapping[str, str]]
               ) -> tuple[dict[str, str], dict[tuple[str, str], str]]:
    """(namespace -> the workspace it belongs to, (workspace, namespace) -> the other workspace that holds it).
    The label decides between claimants, then age (creationTimestamp, then name)."""
    claims: dict[str, list[Workspace]] = {}
    for ws in sorted(workspaces, key=lambda w: (w.created, w.name)):
        for ns in ws.namespaces:
            claims.setdefault(ns, []).append(ws)
    owner: dict[str, str] = {}
    lost: dict[tuple[str, str], str] = {}
    for ns, wss in claims.items():
        labelled = (namespace_labels.get(ns) or {}).get(WORKSPACE_LABEL)
        winner = next((w for w in wss if w.name == labelled), wss[0])
        owner[ns] = winner.name
        for w in wss:
            if w is not winner:
                lost[w.name, ns] = winner.name
    return owner, lost


def core_workspace(namespace: str, resource: str, owner: Mapping[str, str]) -> str:
    """The policy core's workspace (its quota unit) for a GPR: ``<workspace>|<resource>`` in a workspace, the
    namespace otherwise (a namespace name never holds '|')."""
    ws = owner.get(namespace)
    return f"{ws}|{resource}" if ws else namespace


def quotas(workspaces: Iterable[Workspace]) -> dict[str, int]:
    """The core's quotas (device milli) from the resource-wide ``policy.devices`` entries."""
    return {f"{w.name}|{d.resource}": d.max * 1000 for w in workspaces for d in w.policy.devices if not d.model}


def model_caps(workspaces: Iterable[Workspace]) -> dict[str, dict[str, int]]:
    """The core's model caps (core workspace -> device model -> device milli) from the ``policy.devices``
    entries with a model."""
    out: dict[str, dict[str, int]] = {}
    for w in workspaces:
        for d in w.policy.devices:
            if d.model:
                out.setdefault(f"{w.name}|{d.resource}", {})[d.model] = d.max * 1000
    return out


@dataclass(frozen=True)
class WorkspaceIndex:
    """What a GPR pass needs of the workspaces: the namespace -> workspace map, the core's quotas and model
    caps."""

    owner: Mapping[str, str] = field(default_factory=dict)
    quotas: Mapping[str, int] = field(default_factory=dict)
    model_caps: Mapping[str, Mapping[str, int]] = field(default_factory=dict)

    def key(self, namespace: str, resource: str) -> str:
        return core_workspace(namespace, resource, self.owner)


def index(workspaces: Iterable[Workspace], namespace_labels: Mapping[str, Mapping[str, str]]) -> WorkspaceIndex:
    wss = list(workspaces)
    owner, _ = membership(wss, namespace_labels)
    return WorkspaceIndex(owner, quotas(wss), model_caps(wss))


# ---- desired objects -----------------------------------------------------------------------------------------
def role_name(role: str) -> str:
    return f"{ROLE_PREFIX}{role}"


def _owner_ref(ws: Workspace) -> list[dict[str, Any]]:
    return [{"apiVersion": f"{GROUP}/{VERSION}", "kind": WORKSPACE_KIND, "name": ws.name, "uid": ws.uid,
             "blockOwnerDeletion": False}] if ws.uid else []


def _meta(ws: Workspace, namespace: str, name: str) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": {WORKSPACE_LABEL: ws.name, MANAGED_LABEL: MANAGED_BY},
            "ownerReferences": _owner_ref(ws)}


def _subject(s: Subject, namespace: str) -> dict[str, Any]:
    if s.kind == "ServiceAccount":
        return {"kind": "ServiceAccount", "name": s.name, "namespace": s.namespace or namespace}
    return {"kind": s.kind, "name": s.name, "apiGroup": RBAC_GROUP}


def desired_objects(ws: Workspace, namespace: str, rules: Mapping[str, list[dict[str, Any]]],
                    in_workspace: set[str]) -> list[tuple[str, dict[str, Any]]]:
    """(kind, body) of every object the workspace wants in one of its namespaces: a Role per role with usable
    rules, a RoleBinding per role with subjects, a ServiceAccount per rule that names one living here."""
    out: list[tuple[str, dict[str, Any]]] = []
    for role in ROLES:
        if role in rules:
            out.append(("Role", {"apiVersion": f"{RBAC_GROUP}/v1", "kind": "Role",
                                 "metadata": _meta(ws, namespace, role_name(role)), "rules": rules[role]}))
        subjects = sorted({json.dumps(_subject(s, namespace), sort_keys=True) for s in ws.access if s.role == role})
        if subjects:
            out.append(("RoleBinding", {
                "apiVersion": f"{RBAC_GROUP}/v1", "kind": "RoleBinding",
                "metadata": _meta(ws, namespace, role_name(role)),
                "roleRef": {"apiGroup": RBAC_GROUP, "kind": "Role", "name": role_name(role)},
                "subjects": [json.loads(s) for s in subjects]}))
    accounts = sorted({s.name for s in ws.access if s.kind == "ServiceAccount"
                       and (s.namespace == namespace or (not s.namespace and namespace in in_workspace))})
    for name in accounts:
        out.append(("ServiceAccount", {"apiVersion": "v1", "kind": "ServiceAccount",
                                       "metadata": _meta(ws, namespace, name)}))
    return out


def _same(kind: str, want: Mapping[str, Any], have: Mapping[str, Any]) -> bool:
    labels = (have.get("metadata") or {}).get("labels") or {}
    if any(labels.get(k) != v for k, v in want["metadata"]["labels"].items()):
        return False
    if kind == "Role":
        return _norm_rules(have.get("rules")) == _norm_rules(want["rules"])
    if kind == "RoleBinding":
        return have.get("roleRef") == want["roleRef"] and _norm_subjects(have.get("subjects")) == \
            _norm_subjects(want["subjects"])
    return True


def _norm_rules(rules: Any) -> list[dict[str, Any]]:
    """Rules as the API server stores them (empty lists dropped), comparable."""
    return [{k: v for k, v in r.items() if v} for r in rules or () if isinstance(r, dict)]


def _norm_subjects(subjects: Any) -> list[tuple[tuple[str, Any], ...]]:
    return sorted(tuple(sorted((k, v) for k, v in s.items() if v)) for s in subjects or () if isinstance(s, dict))


def bound_to_foreign(binding: tuple[str, str, str], obs: Observed) -> bool:
    """Whether the Role a wanted RoleBinding ``(kind, namespace, name)`` refers to (the role of the same name)
    is someone else's: it exists without the managed-by label. Binding to it would give the workspace's
    subjects whatever that Role grants instead of the role template; the binding is left out (an existing one
    is deleted) until the name is free."""
    role = ("Role", binding[1], binding[2])
    return role in obs.foreign and role not in obs.managed


# ---- the plan ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Action:
    verb: str  # create | update | delete | label | unlabel | create-namespace
    kind: str  # Namespace | Role | RoleBinding | ServiceAccount
    namespace: str
    name: str
    workspace: str
    body: Any = None
    uid: str = ""

    @property
    def key(self) -> str:
        return f"{self.kind} {self.namespace + '/' if self.namespace else ''}{self.name}"


@dataclass
class Observed:
    """What the informers hold. ``managed``: objects with :data:`MANAGED_LABEL`, by (kind, namespace, name);
    ``namespaces``: every namespace by name; ``gprs``: GPR objects; ``models``: node -> device model;
    ``errors``: workspace -> what the API answered to the last pass's writes; ``foreign``: (kind, namespace,
    name) of objects that exist without the label (a create answered AlreadyExists)."""

    workspaces: list[dict[str, Any]]
    namespaces: Mapping[str, dict[str, Any]]
    managed: Mapping[tuple[str, str, str], dict[str, Any]]
    templates: Mapping[str, Any] | None = None
    gprs: Iterable[Mapping[str, Any]] = ()
    models: Mapping[str, str] = field(default_factory=dict)
    errors: Mapping[str, str] = field(default_factory=dict)
    foreign: frozenset[tuple[str, str, str]] = frozenset()
    now: str = ""  # RFC 3339, for lastTransitionTime


@dataclass
class Plan:
    actions: list[Action] = field(default_factory=list)
    statuses: dict[str, dict[str, Any]] = field(default_factory=dict)  # workspace -> status body to write
    index: WorkspaceIndex = field(default_factory=WorkspaceIndex)
    wanted: set[tuple[str, str, str]] = field(default_factory=set)  # (kind, namespace, name) wanted now


def plan(obs: Observed) -> Plan:
    out = Plan()
    wss = [parse_workspace(o) for o in obs.workspaces if (o.get("metadata") or {}).get("name")]
    labels = {n: ((o.get("metadata") or {}).get("labels") or {}) for n, o in obs.namespaces.items()}
    owner, lost = membership(wss, labels)
    out.index = WorkspaceIndex(owner, quotas(wss), model_caps(wss))
    rules, template_errors = parse_templates(obs.templates)
    wanted: set[tuple[str, str, str]] = set()
    keep_roles = {r for r in ROLES if r in template_errors}  # leave those Roles alone until the template is fixed
    problems: dict[str, list[str]] = {w.name: [] for w in wss}
    ns_status: dict[str, list[dict[str, Any]]] = {w.name: [] for w in wss}
    pending: dict[str, bool] = {w.name: False for w in wss}

    for ws in wss:
        mine = {ns for ns in ws.namespaces if owner.get(ns) == ws.name}
        for ns in ws.namespaces:
            row: dict[str, Any] = {"name": ns}
            obj = obs.namespaces.get(ns)
            created = _map(_map(_map(obj).get("metadata")).get("annotations")).get(CREATED_ANNOTATION) == ws.name
            if ns not in mine:
                row.update(adopted=False, ready=False, message=f"belongs to workspace {lost[ws.name, ns]}")
                problems[ws.name].append(f"namespace {ns} belongs to workspace {lost[ws.name, ns]}")
                ns_status[ws.name].append(row)
                continue
            row["adopted"] = bool(obj) and not created
            if obj is None:
                out.actions.append(Action("create-namespace", "Namespace", "", ns, ws.name, {
                    "apiVersion": "v1", "kind": "Namespace",
                    "metadata": {"name": ns, "labels": {WORKSPACE_LABEL: ws.name},
                                 "annotations": {CREATED_ANNOTATION: ws.name}}}))
                row["adopted"] = False
                pending[ws.name] = True
            elif labels[ns].get(WORKSPACE_LABEL) != ws.name:
                out.actions.append(Action("label", "Namespace", "", ns, ws.name,
                                          {"metadata": {"labels": {WORKSPACE_LABEL: ws.name}}}))
                pending[ws.name] = True
            terminating = _map(_map(obj).get("status")).get("phase") == "Terminating"
            ready = obj is not None and not terminating
            for kind, body in desired_objects(ws, ns, rules, mine):
                key = (kind, ns, body["metadata"]["name"])
                if kind == "RoleBinding" and bound_to_foreign(key, obs):
                    continue  # never bind the workspace's subjects to someone else's Role (reported as NameTaken)
                wanted.add(key)
                if key in obs.foreign and key not in obs.managed:  # exists without the label: not ours
                    if kind != "ServiceAccount":  # (a ServiceAccount that exists is all a rule needs)
                        problems[ws.name].append(f"{kind} {ns}/{key[2]} exists and is not the controller's; "
                                                 "it is left alone")
                    continue
                have = obs.managed.get(key)
                if have is None:
                    if obj is not None and not terminating:
                        out.actions.append(Action("create", kind, ns, key[2], ws.name, body))
                    ready = False
                elif not _same(kind, body, have):
                    meta = have.get("metadata") or {}
                    if kind == "RoleBinding" and have.get("roleRef") != body["roleRef"]:  # roleRef is immutable
                        out.actions.append(Action("delete", kind, ns, key[2], ws.name, uid=_str(meta.get("uid"))))
                    else:
                        body = {**body, "metadata": {**body["metadata"],
                                                     "resourceVersion": meta.get("resourceVersion")}}
                        out.actions.append(Action("update", kind, ns, key[2], ws.name, body))
                    ready = False
            if terminating:
                row["message"] = "the namespace is being deleted"
            row["ready"] = ready
            pending[ws.name] = pending[ws.name] or not ready
            ns_status[ws.name].append(row)

    # labels of namespaces a workspace let go (or of a workspace that is gone): taken off, the namespace stays;
    # so does the created-by annotation of a workspace that no longer holds the namespace (it stayed after the
    # workspace was deleted, and a workspace of that name made later counted the namespace as its own creation)
    for ns, lab in sorted(labels.items()):
        claimed = lab.get(WORKSPACE_LABEL)
        made_by = _str(_map(_map(obs.namespaces[ns].get("metadata")).get("annotations")).get(CREATED_ANNOTATION))
        patch: dict[str, Any] = {}
        if claimed and ns not in owner:  # (a namespace another workspace holds is relabelled above)
            patch["labels"] = {WORKSPACE_LABEL: None}
        if made_by and owner.get(ns) != made_by:
            patch["annotations"] = {CREATED_ANNOTATION: None}
        if patch:
            out.actions.append(Action("unlabel", "Namespace", "", ns, claimed or made_by, {"metadata": patch}))
    # exactly what the controller created and nobody wants any more
    for key, have in sorted(obs.managed.items()):
        kind, ns, name = key
        meta = have.get("metadata") or {}
        ws_name = _str((meta.get("labels") or {}).get(WORKSPACE_LABEL))
        if key in wanted or meta.get("deletionTimestamp"):
            continue
        if kind == "Role" and name in {role_name(r) for r in keep_roles} and owner.get(ns) == ws_name:
            continue
        out.actions.append(Action("delete", kind, ns, name, ws_name, uid=_str(meta.get("uid"))))

    out.wanted = wanted
    usage = _usage(wss, owner, obs.gprs, obs.models)
    for ws in wss:
        errs = list(problems[ws.name])
        errs += [f"role template {r}: {m}" for r, m in sorted(template_errors.items())]
        if ws.error:
            errs.insert(0, ws.error)
        if obs.errors.get(ws.name):
            errs.append(obs.errors[ws.name])
        body = _status(ws, ns_status[ws.name], usage.get(ws.name, ([], {})), errs, pending[ws.name], obs.now)
        if status_differs(ws.status, body):
            out.statuses[ws.name] = body
    return out


def _usage(wss: list[Workspace], owner: Mapping[str, str], gprs: Iterable[Mapping[str, Any]],
           models: Mapping[str, str]) -> dict[str, tuple[list[dict[str, Any]], dict[str, int]]]:
    """Per workspace: (usage rows against ``policy.devices``, GPR counts by phase)."""
    rows: dict[str, dict[tuple[str, str], dict[str, Any]]] = {}
    counts: dict[str, dict[str, int]] = {}
    for ws in wss:
        rows[ws.name] = {(d.resource, d.model): {"resource": d.resource, "model": d.model, "max": d.max, "inUse": 0,
                                                 "reserved": 0, "queued": 0} for d in ws.policy.devices}
        counts[ws.name] = {"queued": 0, "admitted": 0, "running": 0}
    for obj in gprs:
        meta = obj.get("metadata") or {}
        ws_name = owner.get(_str(meta.get("namespace")))
        if ws_name is None or meta.get("deletionTimestamp"):
            continue
        spec, status = _map(obj.get("spec")), _map(obj.get("status"))
        phase = status.get("phase") or "Queued"
        resource = _str(spec.get("resource")) or gr.GPU
        table = rows[ws_name]
        if phase == "Queued":
            counts[ws_name]["queued"] += 1
            want = _int(spec.get("devicesPerNode"), 1) * _int(spec.get("nodeCount"), 1)
            pinned = spec.get("models") if isinstance(spec.get("models"), list) else []
            for (res, model), row in table.items():
                if res == resource and (not model or pinned == [model]):
                    row["queued"] += want
            if (resource, "") not in table:
                table[resource, ""] = {"resource": resource, "model": "", "inUse": 0, "reserved": 0, "queued": want}
            continue
        if phase not in ("Admitted", "Running", "Evicting"):
            continue
        counts[ws_name]["running" if phase == "Running" else "admitted"] += 1
        column = "inUse" if phase == "Running" else "reserved"
        for node, devices in gr.reservation_of(dict(obj)).items():
            for (res, model), row in list(table.items()):
                if res == resource and (not model or models.get(node) == model):
                    row[column] += devices
            if (resource, "") not in table:
                table[resource, ""] = {"resource": resource, "model": "", "inUse": 0, "reserved": 0, "queued": 0,
                                       column: devices}
    return {name: ([t[k] for k in sorted(t)], counts[name]) for name, t in rows.items()}


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _status(ws: Workspace, namespaces: list[dict[str, Any]], usage: tuple[list[dict[str, Any]], dict[str, int]],
            errors: list[str], pending: bool, now: str) -> dict[str, Any]:
    if errors:
        ready = ("False", _reason(errors[0]), "; ".join(errors)[:1000])
    elif pending:
        ready = ("False", "Reconciling", "creating or updating namespaces and RBAC objects")
    else:
        ready = ("True", "Reconciled", f"{len(namespaces)} namespaces, {len(ws.access)} access rules in place")
    previous = next((c for c in ws.status.get("conditions") or () if isinstance(c, Mapping)
                     and c.get("type") == "Ready"), None)
    since = previous.get("lastTransitionTime") if previous and previous.get("status") == ready[0] else None
    members = [{"kind": s.kind, "name": s.name, **({"namespace": s.namespace} if s.namespace else {}), "role": s.role}
               for s in ws.access]
    return {"observedGeneration": ws.generation, "namespaces": namespaces, "members": members, "usage": usage[0],
            "gprs": usage[1], "conditions": [{"type": "Ready", "status": ready[0], "reason": ready[1],
                                              "message": ready[2], "lastTransitionTime": since or now}]}


def _reason(message: str) -> str:
    if "belongs to workspace" in message:
        return "NamespaceConflict"
    if "role template" in message:
        return "RoleTemplateInvalid"
    if " 403" in f" {message}" or "Forbidden" in message:
        return "Forbidden"
    if message.startswith("spec."):
        return "InvalidSpec"
    if "not the controller's" in message:
        return "NameTaken"
    return "Error"


