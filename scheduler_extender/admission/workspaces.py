"""What admission decides about workspaces, as pure functions the webhook (:mod:`webhook`) calls:

- :func:`gpr_refusal`: a GPR against its workspace's ``spec.policy`` (priority range, exitDuration and idle
  timeout bounds, unfinished GPRs across the workspace, and a request that no device quota could ever hold);
- :func:`choose_template`: the GPRTemplate automatic GPRs use for a pod, from the GPRTemplateBindings that
  match it (highest weight, then the most specific: workloadSelector > namespaces > workspace, then the name);
- :func:`workspace_refusal` and :func:`binding_refusal`: specs the CRD schema cannot judge (a namespace another
  workspace holds, a system namespace, a binding that reaches outside its own workspace);
- :func:`adoption_questions` and :func:`adoption_refusal`: a Workspace that lists an existing namespace it did not
  create hands out, there, every right of the roles its access rules name, so whoever writes its spec must hold
  those rights there already: the rule the API server applies to a RoleBinding (you cannot grant what you do not
  have). The webhook asks the API server one SubjectAccessReview per right for the requesting user.

A binding lives beside its template and reaches only its own namespace or namespaces of the workspace its
namespace belongs to: a team cannot steer another team's pods to its templates.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from scheduler_extender.core.gpr import GPR
from scheduler_extender.objects.gpr_codec import format_duration
from scheduler_extender.objects.selectors import selector_matches
from scheduler_extender.objects.workspaces import (
    CREATED_ANNOTATION,
    WORKSPACE_LABEL,
    PolicyError,
    Workspace,
    parse_policy,
    parse_workspace,
)

SYSTEM_NAMESPACES = ("kube-system", "kube-public", "kube-node-lease")
TERMINAL = ("Complete", "Cancelled")  # as gpr_resource.is_terminal: a GPR that will not come back


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def member_of(namespace: Mapping[str, Any] | None, workspace: Mapping[str, Any] | None) -> Workspace | None:
    """The workspace a namespace belongs to, as admission sees it: the namespace's ``accelstack.io/workspace``
    label names it and the workspace lists the namespace (a label alone joins nothing)."""
    if not namespace or not workspace:
        return None
    ws = parse_workspace(workspace)
    name = str((namespace.get("metadata") or {}).get("name") or "")
    return ws if name in ws.namespaces else None


def workspace_label(namespace: Mapping[str, Any] | None) -> str:
    labels = ((namespace or {}).get("metadata") or {}).get("labels") or {}
    value = labels.get(WORKSPACE_LABEL) if isinstance(labels, Mapping) else None
    return value if isinstance(value, str) else ""


# ---- GPRs ----------------------------------------------------------------------------------------------------
def gpr_refusal(g: GPR, ws: Workspace, unfinished: int | None) -> str:
    """Why ``g`` breaks its workspace's policy ('' when it does not). ``unfinished``: the workspace's unfinished
    GPRs other than ``g`` (None: not counted, an update)."""
    p, where = ws.policy, f"workspace {ws.name}"
    if p.priority_range is not None and not p.priority_range[0] <= g.priority <= p.priority_range[1]:
        return (f"spec.priority: {g.priority} is outside {p.priority_range[0]}-{p.priority_range[1]}, the range "
                f"{where} allows (spec.policy.priorityRange)")
    for field, value, limit, key in (("exitDuration", g.exit_duration_s, p.max_exit_s, "maxExitDuration"),
                                     ("idleTimeout", g.idle_timeout_s, p.max_idle_s, "maxIdleTimeout")):
        if limit is None:
            continue
        if value is None:
            return f"spec.{field}: required in {where}, at most {format_duration(limit)} (spec.policy.{key})"
        if value > limit:
            return (f"spec.{field}: {format_duration(value)} is over {format_duration(limit)}, the most {where} "
                    f"allows (spec.policy.{key})")
    total = g.devices_per_node * g.node_count
    for d in p.devices:
        if d.resource == g.resource and not d.model and total > d.limit:
            return (f"spec: {total} {g.resource} ({g.devices_per_node} per node x {g.node_count} nodes) is more "
                    f"than {where} may hold at once ({d.limit}, spec.policy.devices); it could never be admitted")
    caps = {d.model: d.limit for d in p.devices if d.resource == g.resource and d.model}
    if g.models and all(m in caps for m in g.models) and total > max(caps[m] for m in g.models):
        return (f"spec: {total} {g.resource} of models {', '.join(g.models)} is more than {where} may hold of "
                f"them at once ({max(caps[m] for m in g.models)}, spec.policy.devices); it could never be admitted")
    if unfinished is not None and p.max_gprs is not None and unfinished + 1 > p.max_gprs:
        return (f"{where} already has {unfinished} unfinished GPRs, the most it allows is {p.max_gprs} "
                "(spec.policy.maxGPRs); delete finished or unneeded GPRs first")
    return ""


def unfinished(phases: Iterable[str]) -> int:
    return sum(1 for p in phases if p not in TERMINAL)


# ---- template bindings ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Choice:
    namespace: str  # of the template (and the binding)
    template: str
    binding: str  # "<namespace>/<name>" of the binding; "" for a fallback
    why: str  # for the pod's warning


def _reach(binding: Mapping[str, Any]) -> tuple[str, str, list[str], str]:
    meta = binding.get("metadata") or {}
    spec = _map(binding.get("spec"))
    names = [n for n in spec.get("namespaces") or () if isinstance(n, str)]
    ws = spec.get("workspace")
    ws = ws if isinstance(ws, str) else ""
    return str(meta.get("namespace") or ""), str(meta.get("name") or ""), names, ws


def needs_owner_labels(bindings: Iterable[Mapping[str, Any]]) -> bool:
    return any(isinstance(b.get("spec"), Mapping) and b["spec"].get("workloadSelector") is not None for b in bindings)


def choose_template(bindings: Iterable[Mapping[str, Any]], namespace: str, ws: Workspace | None,
                    workload_labels: Mapping[str, str] | None, annotation: str | None) -> Choice | None:
    """The template for an automatic GPR of a pod in ``namespace`` (``ws``: its workspace or None;
    ``workload_labels``: of its owning workload, None when they could not be read: selectors then match
    nothing), else the namespace annotation, else the workspace's default template."""
    best: tuple[tuple[int, int, str], Choice] | None = None  # (-weight, -specificity, binding), choice
    for b in bindings:
        home, name, names, ws_name = _reach(b)
        spec = _map(b.get("spec"))
        template = spec.get("template")
        if not isinstance(template, str) or not template:
            continue
        same_workspace = ws is not None and home in ws.namespaces
        if names:  # (with a workspace too: only those of them in it)
            if namespace not in names or not (home == namespace or same_workspace) \
                    or (ws_name and (ws is None or ws_name != ws.name)):
                continue
            specificity = 1
        elif ws_name:
            if ws is None or ws_name != ws.name or not same_workspace:
                continue
            specificity = 0
        else:
            if home != namespace:
                continue
            specificity = 1
        selector = spec.get("workloadSelector")
        if selector is not None:
            if workload_labels is None or not selector_matches(selector, workload_labels):
                continue
            specificity = 2
        weight = spec.get("weight")
        weight = weight if isinstance(weight, int) else 0
        choice = Choice(home, template, f"{home}/{name}", f"GPRTemplateBinding {home}/{name}")
        key = (-weight, -specificity, choice.binding)  # highest weight, most specific, first name
        if best is None or key < best[0]:
            best = (key, choice)
    if best is not None:
        return best[1]
    if annotation:
        return Choice(namespace, annotation, "", "the namespace's default-template annotation")
    if ws is not None and ws.default_template is not None:
        return Choice(ws.default_template[0], ws.default_template[1], "",
                      f"workspace {ws.name}'s spec.defaultTemplate")
    return None


# ---- Workspace and GPRTemplateBinding specs ------------------------------------------------------------------
def workspace_refusal(obj: Mapping[str, Any], others: Iterable[Mapping[str, Any]], own_namespace: str) -> str:
    """Why a Workspace spec cannot be accepted ('' when it can): its policy, a system namespace, or a
    namespace another workspace lists."""
    ws = parse_workspace(obj)
    if ws.error:
        return ws.error
    try:
        parse_policy(_map(obj.get("spec")).get("policy"))
    except PolicyError as exc:
        return str(exc)
    for ns in ws.namespaces:
        if ns in SYSTEM_NAMESPACES or ns == own_namespace:
            return (f"spec.namespaces: {ns} is a system namespace (or accelstack's own); a workspace cannot own "
                    "it")
    for other in others:
        o = parse_workspace(other)
        if o.name == ws.name:
            continue
        taken = sorted(set(ws.namespaces) & set(o.namespaces))
        if taken:
            return (f"spec.namespaces: {', '.join(taken)} already belong{'s' if len(taken) == 1 else ''} to "
                    f"workspace {o.name}; a namespace belongs to one workspace (remove it there first)")
    if ws.default_template is not None and ws.default_template[0] not in ws.namespaces:
        return "spec.defaultTemplate.namespace: must be one of spec.namespaces"
    return ""


def binding_refusal(obj: Mapping[str, Any], home_ws: Workspace | None) -> str:
    """Why a GPRTemplateBinding cannot be accepted ('' when it can): it reaches outside its own workspace (or,
    in a namespace of no workspace, outside its own namespace), or its selector is malformed."""
    home, _, names, ws_name = _reach(obj)
    spec = _map(obj.get("spec"))
    if not isinstance(spec.get("template"), str) or not spec.get("template"):
        return "spec.template: required, the name of a GPRTemplate in the binding's namespace"
    where = (f"namespace {home} belongs to no workspace" if home_ws is None
             else f"namespace {home} belongs to workspace {home_ws.name}")
    if ws_name and (home_ws is None or ws_name != home_ws.name):
        return (f"spec.workspace: {ws_name} is not the binding's own workspace ({where}); a binding reaches "
                "only the workspace of the namespace it lives in")
    outside = [n for n in names if n != home and (home_ws is None or n not in home_ws.namespaces)]
    if outside:
        return (f"spec.namespaces: {', '.join(outside)} {'is' if len(outside) == 1 else 'are'} outside the "
                f"binding's reach ({where}); a binding reaches only its own namespace or its workspace's")
    selector = spec.get("workloadSelector")
    if selector is not None:
        if not isinstance(selector, Mapping):
            return "spec.workloadSelector: must be a label selector (matchLabels, matchExpressions)"
        for i, expr in enumerate(selector.get("matchExpressions") or ()):
            op = expr.get("operator") if isinstance(expr, Mapping) else None
            values = expr.get("values") if isinstance(expr, Mapping) else None
            if op not in ("In", "NotIn", "Exists", "DoesNotExist"):
                return f"spec.workloadSelector.matchExpressions[{i}].operator: In, NotIn, Exists or DoesNotExist"
            if (op in ("In", "NotIn")) != bool(values):
                return (f"spec.workloadSelector.matchExpressions[{i}]: In and NotIn need values; Exists and "
                        "DoesNotExist take none")
    return ""


# ---- adopting an existing namespace ----------------------------------------------------------------------------
Question = tuple[str, tuple[tuple[str, str], ...]]  # (namespace, SubjectAccessReview resourceAttributes items)


def adoption_questions(obj: Mapping[str, Any], namespaces: Mapping[str, Mapping[str, Any] | None],
                       rules: Mapping[str, list[dict[str, Any]]]) -> list[Question]:
    """What the writer of a Workspace spec must be allowed in each namespace it adopts: every (verb, group,
    resource[/subresource], name) of the role templates (``rules``) its access rules name. ``namespaces``: the
    namespaces the spec lists, as they exist (None: not there yet, the controller creates it and nothing is
    handed out that anyone held before). A namespace the workspace created itself (its created-by annotation)
    asks nothing."""
    ws = parse_workspace(obj)
    roles = sorted({s.role for s in ws.access})
    asked: dict[Question, None] = {}
    for ns in ws.namespaces:
        existing = namespaces.get(ns)
        if existing is None:
            continue
        annotations = _map(_map(existing.get("metadata")).get("annotations"))
        if annotations.get(CREATED_ANNOTATION) == ws.name:
            continue
        for role in roles:
            for rule in rules.get(role) or ():
                for group in rule.get("apiGroups") or ():
                    for resource in rule.get("resources") or ():
                        res, _, sub = resource.partition("/")
                        for verb in rule.get("verbs") or ():
                            for name in rule.get("resourceNames") or ("",):
                                attrs = {"namespace": ns, "verb": verb, "group": group, "resource": res,
                                         "subresource": sub, "name": name}
                                asked[(ns, tuple((k, v) for k, v in attrs.items() if v or k == "group"))] = None
    return list(asked)


def review_spec(user: Mapping[str, Any], question: Question) -> dict[str, Any]:
    """A SubjectAccessReview spec asking ``question`` for the requesting user of an AdmissionReview."""
    spec: dict[str, Any] = {"resourceAttributes": dict(question[1]), "user": str(user.get("username") or "")}
    for key in ("groups", "uid", "extra"):
        if user.get(key):
            spec[key] = user[key]
    return spec


def describe(question: Question) -> str:
    attrs = dict(question[1])
    what = attrs["resource"] + (f"/{attrs['subresource']}" if attrs.get("subresource") else "")
    what += f".{attrs['group']}" if attrs.get("group") else ""
    return f"{attrs['verb']} {what}" + (f" named {attrs['name']}" if attrs.get("name") else "")


def on_behalf(user: Mapping[str, Any], own_namespace: str) -> bool:
    """A write by one of accelstack's own accounts (its REST API writes Workspaces as itself, after checking its
    caller's ``create``): the person behind it is not in the request, so their rights cannot be asked."""
    return str(user.get("username") or "").startswith(f"system:serviceaccount:{own_namespace}:")


def adoption_refusal(user: Mapping[str, Any], questions: list[Question], denied: list[Question],
                     own_namespace: str) -> str:
    """Why the writer may not adopt ('' when there is nothing to adopt or nothing ``denied``)."""
    if not questions:
        return ""
    ns = (denied or questions)[0][0]
    who = str(user.get("username") or "(anonymous)")
    if on_behalf(user, own_namespace):
        return (f"spec.namespaces: {ns} exists and would be adopted; adopting needs the requester's own rights "
                f"there, which {who} (accelstack's own account, acting for someone it cannot name here) may not "
                "vouch for: create or update this Workspace with kubectl as yourself, or list only new namespaces")
    if not denied:
        return ""
    return (f"spec.namespaces: {ns} exists and would be adopted, handing out what the workspace's roles grant "
            f"there; {who} may not {describe(denied[0])} in {ns} ({len(denied)} such right(s) missing): "
            "adopting a namespace needs every right the workspace grants in it (as a RoleBinding does)")
