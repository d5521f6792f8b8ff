"""The daemon's gRPC service: translation only, over the domain in :mod:`kvtier.server.daemon`.

Modules: ``errors`` (domain errors -> status codes, the one mapping), ``messages`` and
``transfer_messages`` (domain -> proto), ``pool_servicer``, ``tier_servicer``, ``transfer_servicer``
(one servicer a service), ``transfer_peer`` (PullKV's calls to the peer daemon), ``registry`` (the
list of services), ``server`` (create_server, serve).
"""

from kvtier.server.service.registry import SERVICES, ServiceEntry
from kvtier.server.service.server import create_server, serve

__all__ = ["SERVICES", "ServiceEntry", "create_server", "serve"]
