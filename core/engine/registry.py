"""The plugin manager: in-repo and third-party plugins come in through one door.

In-repo plugins are declared as entry points of the `servelab` distribution in the group
`servelab.plugins`, exactly as a third-party package declares its own. When servelab runs from a
source tree that is not installed, the in-repo modules are registered by name instead: this is
the one place core/ names a plugin module.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pluggy

from core.config.schema import BASE_CONFIGS, COMPONENT_KINDS, section, to_dict
from core.engine import hookspecs
from core.engine.interfaces import check_contract
from core.errors import ConfigError

hookimpl = pluggy.HookimplMarker("servelab")

ENTRY_POINT_GROUP = "servelab.plugins"
BUILTIN_PLUGINS = (
    "plugins.schedulers.static",
    "plugins.schedulers.continuous",
    "plugins.schedulers.slo",
    "plugins.cache.contiguous",
    "plugins.cache.paged",
    "plugins.quant.none",
    "plugins.quant.int8",
    "plugins.quant.int4",
    "plugins.quant.gguf",
    "plugins.decoders.sampling",
    "plugins.decoders.speculative",
    "plugins.backends.torch_backend",
    "plugins.backends.simulator",
    "plugins.attention.torch_ref",
    "plugins.attention.triton_attn",
    "plugins.attention.cpu_attn",
    "plugins.peers.hf",
)
# kind -> the hook that lists its factories
KINDS = {
    "scheduler": "servelab_schedulers",
    "cache": "servelab_cache_allocators",
    "quant": "servelab_quantizers",
    "decoder": "servelab_decoders",
    "backend": "servelab_backends",
    "attention": "servelab_attention_backends",
    "peer": "servelab_peers",
}
assert tuple(KINDS) == COMPONENT_KINDS


@dataclass(frozen=True)
class Component:
    kind: str
    name: str
    factory: Callable[..., Any]
    source: str  # distribution (with version) or module the plugin came from

    @property
    def config_class(self) -> type:
        cls = getattr(self.factory, "config_class", None) or BASE_CONFIGS[self.kind]
        if not issubclass(cls, BASE_CONFIGS[self.kind]):
            raise ConfigError(f"{self.kind} '{self.name}' (from {self.source}): config_class {cls.__name__} must "
                              f"subclass {BASE_CONFIGS[self.kind].__name__}")
        return cls


class Registry:
    """Every named component, by kind, built from the plugins' hooks."""

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self.pm = pm
        self.components: dict[str, dict[str, Component]] = {kind: {} for kind in KINDS}
        dists = {id(plugin): dist for plugin, dist in pm.list_plugin_distinfo()}
        for kind, hook_name in KINDS.items():
            for impl in getattr(pm.hook, hook_name).get_hookimpls():
                dist = dists.get(id(impl.plugin))
                source = f"{dist.project_name} {dist.version}" if dist else impl.plugin_name
                for name, factory in (impl.function() or {}).items():
                    if name in self.components[kind]:
                        other = self.components[kind][name].source
                        raise ConfigError(f"{kind} '{name}' is provided twice: by {other} and by {source}")
                    self.components[kind][name] = Component(kind, name, factory, source)

    def names(self, kind: str) -> list[str]:
        return sorted(self.components[kind])

    def get(self, kind: str, name: str) -> Component:
        if name not in self.components[kind]:
            available = ", ".join(self.names(kind)) or "none"
            raise ConfigError(f"unknown {kind} '{name}'; available: {available}")
        return self.components[kind][name]

    def config(self, kind: str, node: Any):
        """A component's config section as its plugin's own dataclass (unknown keys rejected)."""
        data = to_dict(node)
        name = data.get("name") or BASE_CONFIGS[kind]().name
        if not isinstance(name, str):
            raise ConfigError(f"{kind}.name must be a string, got {name!r}")
        component = self.get(kind, name)
        return section(component.config_class, data, f"{kind} '{name}'")

    def create(self, kind: str, config: Any, **kwargs: Any) -> Any:
        """Build the component `config.name` names, with its typed config; check its contract. A
        factory gets the context arguments it names (all of them if it takes **kwargs), so context
        added in a later servelab version does not break an older plugin."""
        component = self.get(kind, config.name)
        if not isinstance(config, component.config_class):
            config = self.config(kind, config)
        instance = component.factory(config=config, **accepted(component.factory, kwargs))
        check_contract(kind, component.name, instance, component.source)
        return instance

    def all(self) -> list[Component]:
        return [c for kind in KINDS for c in sorted(self.components[kind].values(), key=lambda c: c.name)]


def accepted(factory: Callable, kwargs: dict) -> dict:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or C callable: give it everything
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager("servelab")
    pm.add_hookspecs(hookspecs)
    pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    for module_name in BUILTIN_PLUGINS:
        if pm.get_plugin(module_name) is None:
            module = importlib.import_module(module_name)
            if not pm.is_registered(module):
                pm.register(module, name=module_name)
    return pm


_registry: Registry | None = None


def get_registry(refresh: bool = False) -> Registry:
    """The process-wide registry (entry points are read once unless `refresh`)."""
    global _registry
    if _registry is None or refresh:
        _registry = Registry(plugin_manager())
    return _registry
