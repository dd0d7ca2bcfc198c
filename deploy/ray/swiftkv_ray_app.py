"""Ray Serve application builder for KubeRay's serveConfigV2 (`import_path: swiftkv_ray_app:build`).

The chart renders one application per pool, `swiftkv-<pool>` (the pool's `ray_app` in the gateway's config),
whose args are the pool's entry of the same platform config `swiftkv serve` reads; the deployment is the
one `swiftkv serve --engine ray` builds (services.serving.ray_backend.build_deployment). The images put
this folder on PYTHONPATH.
"""

from __future__ import annotations

from typing import Any

from services.config import PoolConfig, RoutingConfig
from services.serving.ray_backend import build_deployment


def build(args: dict[str, Any]):
    """args: {"pool": "swiftkv", "served_model_name": "...", "config": {<the pool's platform config>},
    "routing": {<the platform config's routing>}} (routing optional: its defaults)."""
    pool = PoolConfig.model_validate(args["config"])
    routing = RoutingConfig.model_validate(args.get("routing") or {})
    return build_deployment(args["pool"], pool, args["served_model_name"], routing)
