"""One Kubernetes client layer for every accelstack process (the shape of client-go's ``rest`` client,
``tools/cache`` reflector and ``tools/leaderelection``):

- :class:`~kubeapi.client.KubeClient`: every call has a client-side timeout, the HTTP status is always checked
  (errors are :class:`~kubeapi.errors.ApiError` subclasses carrying the API server's ``Status``), reads are
  retried on 429/5xx and transport errors with exponential backoff and jitter (``Retry-After`` honoured), lists
  are paginated, writes carry the component's field manager, and each call is timed in Prometheus.
- :class:`~kubeapi.informer.Informer`: list then watch with bookmarks, a read timeout that ends a half-open watch,
  relist on 410 Gone, backoff on errors, and ``healthy`` false while the resource cannot be listed.
- :class:`~kubeapi.leader.LeaderElector`: a ``coordination.k8s.io/v1`` Lease with lease duration > renew deadline
  > retry period; expiry judged by this replica's own clock since it last saw the record change.
- :func:`~kubeapi.tasks.supervise`: a background task that is restarted (with backoff) when it crashes.
"""

from kubeapi.client import KubeClient
from kubeapi.errors import (
    AlreadyExists,
    ApiError,
    Conflict,
    Expired,
    Forbidden,
    NotFound,
    TooManyRequests,
    TransportError,
)
from kubeapi.resources import Resource

__all__ = ["AlreadyExists", "ApiError", "Conflict", "Expired", "Forbidden", "KubeClient", "NotFound", "Resource",
           "TooManyRequests", "TransportError"]
