"""kvtier as SGLang's HiCache storage backend (extra ``kvtier[sglang]``): ``KVTierStorage``.

Load it in SGLang with::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
      '{"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang", "class_name": "KVTierStorage",
        "interface_v1": 1, "address": "unix:///run/kvtier/kvtier.sock"}'

Modules: ``backend`` (the HiCacheStorage class), ``settings`` (the extra-config keys), ``host_pages``
(SGLang's host pools as unit parts), ``transport`` (how parts reach the daemon). Importing this
package imports SGLang; ``import kvtier`` never does.
"""

from kvtier.integrations.sglang.backend import KVTierStorage
from kvtier.integrations.sglang.settings import BackendSettings

__all__ = ["BackendSettings", "KVTierStorage"]
