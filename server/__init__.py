"""The kvtier daemon: skip-aware DSA pools, tiers, transfer and the gRPC service.

Module map (what may import what):
  model_config, presets      no kvtier imports beyond each other
  pool/                      model_config only (never grpc)
  pool_configurator          model_config, pool (for the exact accounting)
  tiers/                     pool, model_config (never grpc)
  replay/                    tiers, pool, model_config (never grpc): trace, fill, scale, Belady, driver
  transfer/                  pool, model_config, the Mooncake engine (never grpc): PD layouts, plans, engine
  service/ daemon            everything above plus the generated stubs in kvtier.v1
"""
