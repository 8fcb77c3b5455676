"""Drop-in integrations for the frameworks trainers run (docs/integrations/ has a page each).

- `tvclient.integrations.skyrl`: a skyrl_gym entry point, a subclass of your environment class
  (`pip install tvclient[skyrl]`).
- `tvclient.integrations.verl`: a veRL `BaseTool` that wraps another tool or a function tool
  (`tvclient[verl]`, with the CPU torch installed first).
- `tvclient.integrations.tinker`: tinker-cookbook sandboxes, tools and env groups (installed
  with `--no-deps` steps: tinker-cookbook's `tml-renderers` is not on PyPI).
- `tvclient.integrations.harbor`: Harbor `BaseEnvironment` classes (`tvclient[harbor]`).

Each module imports its framework; this package imports none of them, and `import tvclient`
never needs them. All of them run the rollout's tool calls through `ToolCallExecutor`, so they
share its rules: a result is cached only if it is exact JSON, tvcache's own failures run the
rollout uncached instead of reaching the trajectory, and a call that raises leaves the rollout
as the known-state rule says.

The service is named by `TVCACHE_URL` and `TVCACHE_TOKEN` unless a client is passed in.
"""
