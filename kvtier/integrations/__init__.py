"""Adapters that plug kvtier into inference engines. Each is imported only on demand (``import kvtier``
never imports an engine): ``kvtier.integrations.sglang`` is SGLang's HiCache storage backend
(extra ``kvtier[sglang]``)."""
