"""Drop-in wrappers for the frameworks trainers run, each an optional extra of tvclient.

- `tvclient.integrations.skyrl`: a skyrl_gym `BaseTextEnv` wrapper (`pip install tvclient[skyrl]`).
- `tvclient.integrations.verl`: a veRL `BaseTool` that wraps another tool (`tvclient[verl]`).
- `tvclient.integrations.tinker`: tinker-cookbook sandboxes, tools and env groups (`tvclient[tinker]`).
- `tvclient.integrations.harbor`: Harbor `BaseEnvironment` classes (`tvclient[harbor]`).

Each module imports its framework; this package imports none of them, and `import tvclient`
never needs them. All of them run the rollout's tool calls through `ToolCallExecutor`, so a
call that raises leaves the rollout as the executor's known-state rule says.

The service is named by `TVCACHE_URL` and `TVCACHE_TOKEN` unless a client is passed in.
"""
