"""The released frameworks, driven through their own rollout code against a served tvcache.

`venvs` builds each framework's virtualenv; the other modules are drivers, scripts that run
in those venvs (no Django) and print what a rollout observed, for the integration tests and
the framework benchmark alike.
"""
