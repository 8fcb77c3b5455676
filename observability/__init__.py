"""What the service reports about itself: Prometheus metrics counted as it works (`metrics`) and
structured logs with request ids (`logs`).

A neutral package below every app: `cache`, `sandboxes`, `dashboard` and `workers` may import
it, and it imports none of them (nor Django models), so the hot paths count into it without an
upward import. What is read from the database at scrape time (live sandboxes, snapshots,
divergences, queue depths) is collected by the /metrics view in `tvcache_site.metrics`, the top
layer, which may read every app.
"""
