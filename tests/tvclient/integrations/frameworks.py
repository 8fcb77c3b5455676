"""The frameworks under test, as far as they install on this machine (Python 3.11, no torch).

- skyrl-gym installs with its dependencies: used as it is.
- veRL is installed with `pip install --no-deps verl`. Its package root and `verl.utils` import
  torch and ray, which the tool interface does not use: without torch, those two package
  modules are replaced by empty ones (and `verl.utils.ray_utils` by its one function the
  tracing decorator needs), so that the real `verl/tools/base_tool.py` and `schemas.py` load.
- tinker-cookbook is installed with `pip install --no-deps tinker-cookbook tinker`. Its
  renderers import torch; without torch, `tinker_cookbook.renderers` is replaced by the type
  names the tool and RL types import from it, so that the real `tool_use/types.py`,
  `rl/types.py` and `sandbox/sandbox_interface.py` load.
- Harbor needs Python 3.12 and does not install here: without it, `harbor_standin` provides
  its `BaseEnvironment` with the signatures Harbor documents.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import sys
import types


def _package(name: str, path: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = [path]
    sys.modules[name] = module
    return module


def load_verl() -> None:
    if importlib.util.find_spec("torch") is None and "verl.tools.base_tool" not in sys.modules:
        root = importlib.util.find_spec("verl").submodule_search_locations[0]
        _package("verl", root)
        _package("verl.utils", f"{root}/utils")
        ray_utils = types.ModuleType("verl.utils.ray_utils")
        ray_utils.get_event_loop = asyncio.get_event_loop
        sys.modules["verl.utils.ray_utils"] = ray_utils
    importlib.import_module("verl.tools.base_tool")


def load_tinker() -> None:
    if importlib.util.find_spec("torch") is None and "tinker_cookbook.rl.types" not in sys.modules:
        import tinker_cookbook

        renderers = types.ModuleType("tinker_cookbook.renderers")
        renderers.__path__ = []
        base = types.ModuleType("tinker_cookbook.renderers.base")
        for module in (renderers, base):
            module.Message = dict
            module.ToolSpec = dict
            module.Renderer = object
        renderers.base = base
        sys.modules["tinker_cookbook.renderers"] = renderers
        sys.modules["tinker_cookbook.renderers.base"] = base
        tinker_cookbook.renderers = renderers
        # tool_use/__init__ imports the message env, which needs the real renderers.
        _package("tinker_cookbook.tool_use", f"{tinker_cookbook.__path__[0]}/tool_use")
    importlib.import_module("tinker_cookbook.tool_use.types")
    importlib.import_module("tinker_cookbook.rl.types")


def load_harbor() -> bool:
    """True if the real Harbor is installed; else the stand-in is put in its place."""
    try:
        importlib.import_module("harbor.environments.base")
        return True
    except (ImportError, SyntaxError):
        from . import harbor_standin

        harbor_standin.install()
        return False
