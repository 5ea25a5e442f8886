"""Resource descriptors: where a kind lives in the REST API (group, version, plural, scope)."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote


@dataclass(frozen=True)
class Resource:
    group: str  # "" for the core group
    version: str
    plural: str
    kind: str
    namespaced: bool = True

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, namespace: str | None = None, name: str | None = None, subresource: str | None = None) -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced and namespace:
            base += f"/namespaces/{quote(namespace, safe='')}"
        base += f"/{self.plural}"
        if name is not None:
            base += f"/{quote(name, safe='')}"
            if subresource:
                base += f"/{subresource}"
        return base


NODES = Resource("", "v1", "nodes", "Node", namespaced=False)
PODS = Resource("", "v1", "pods", "Pod")
EVENTS = Resource("", "v1", "events", "Event")
NAMESPACES = Resource("", "v1", "namespaces", "Namespace", namespaced=False)
CONFIGMAPS = Resource("", "v1", "configmaps", "ConfigMap")
SECRETS = Resource("", "v1", "secrets", "Secret")
SERVICES = Resource("", "v1", "services", "Service")
LEASES = Resource("coordination.k8s.io", "v1", "leases", "Lease")
TOKEN_REVIEWS = Resource("authentication.k8s.io", "v1", "tokenreviews", "TokenReview", namespaced=False)
SUBJECT_ACCESS_REVIEWS = Resource("authorization.k8s.io", "v1", "subjectaccessreviews", "SubjectAccessReview",
                                  namespaced=False)
GPRS = Resource("accelstack.io", "v1alpha1", "gpuprovisioningrequests", "GPUProvisioningRequest")
GPR_TEMPLATES = Resource("accelstack.io", "v1alpha1", "gprtemplates", "GPRTemplate")
SERVICE_ACCOUNTS = Resource("", "v1", "serviceaccounts", "ServiceAccount")
ROLES = Resource("rbac.authorization.k8s.io", "v1", "roles", "Role")
ROLE_BINDINGS = Resource("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding")
WORKSPACES = Resource("accelstack.io", "v1alpha1", "workspaces", "Workspace", namespaced=False)
ACCELERATOR_NODES = Resource("accelstack.io", "v1alpha1", "acceleratornodes", "AcceleratorNode", namespaced=False)
GPR_TEMPLATE_BINDINGS = Resource("accelstack.io", "v1alpha1", "gprtemplatebindings", "GPRTemplateBinding")
# owners whose labels a GPRTemplateBinding's workloadSelector matches
JOBS = Resource("batch", "v1", "jobs", "Job")
CRON_JOBS = Resource("batch", "v1", "cronjobs", "CronJob")
REPLICA_SETS = Resource("apps", "v1", "replicasets", "ReplicaSet")
DEPLOYMENTS = Resource("apps", "v1", "deployments", "Deployment")
STATEFUL_SETS = Resource("apps", "v1", "statefulsets", "StatefulSet")
DAEMON_SETS = Resource("apps", "v1", "daemonsets", "DaemonSet")
