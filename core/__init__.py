"""The service's base layer: what every app uses and that is not the tool call graph.

Typed errors and their one JSON answer (`errors`, `api.errors`), the JSON checks every request
body goes through (`inputs`, and the DRF parser and renderer in `api.rendering`), background jobs
(`background`: the one seam to Celery) and the small per-process cache with lifetimes (`ttl`).
It sits below every app (`accounts`, `cache`, `sandboxes`, ...) and imports none of them.
"""
