"""Explicit name -> object registries for algorithms, checkpoint formats and architecture adapters.

A leaf: it imports no plugin. Plugins add themselves here when imported (the built-ins are imported
by `quantkit.plugins.builtins`, which `quantkit.plugins.catalog`, the one place plugins are looked up, imports);
third-party packages register through the `quantkit.plugins` entry point group (see `load_plugins`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Callable, Generic, Iterator, TypeVar

from quantkit.errors import PluginError, UnknownNameError

log = logging.getLogger(__name__)
T = TypeVar("T")
ENTRY_POINT_GROUP = "quantkit.plugins"


@dataclass(frozen=True)
class Entry(Generic[T]):
    name: str
    obj: T
    source: str  # "quantkit" for built-ins, else the plugin's entry point "name = module:attr"


class Registry(Generic[T]):
    """A named collection of one kind of plugin; registering a name twice is an error."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Entry[T]] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            self.add(name, obj)
            return obj

        return decorator

    def add(self, name: str, obj: T) -> None:
        if not name or name != name.strip():
            raise PluginError(f"{self.kind} name {name!r} is empty or has surrounding spaces")
        if name in self._entries:
            prev = self._entries[name]
            raise PluginError(
                f"{self.kind} {name!r} is registered twice: by {prev.source} and by {_current_source()}"
            )
        self._entries[name] = Entry(name, obj, _current_source())

    def get(self, name: str) -> T:
        load_plugins()
        try:
            return self._entries[name].obj
        except KeyError:
            known = ", ".join(sorted(self._entries)) or "(none)"
            raise UnknownNameError(f"unknown {self.kind} {name!r}; known {self.kind}s: {known}") from None

    def __contains__(self, name: str) -> bool:
        load_plugins()
        return name in self._entries

    def entries(self) -> Iterator[Entry[T]]:
        load_plugins()
        return iter(sorted(self._entries.values(), key=lambda e: e.name))

    def names(self) -> list[str]:
        return [e.name for e in self.entries()]


_SOURCE = ["quantkit"]


def _current_source() -> str:
    return _SOURCE[-1]


ALGORITHMS: Registry = Registry("algorithm")
FORMATS: Registry = Registry("format")
ARCHITECTURES: Registry = Registry("architecture")

_plugins_loaded = False


def load_plugins() -> None:
    """Import every `quantkit.plugins` entry point, once per process (the built-ins are already
    registered by whoever looks things up: `quantkit.plugins.catalog` imports `quantkit.plugins.builtins`).

    An entry point may name a module (importing it registers things) or a callable (called with
    no arguments). A plugin that fails to import raises PluginError naming the plugin.
    """
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        label = f"plugin {ep.name!r} ({ep.value})"
        _SOURCE.append(label)
        try:
            obj = ep.load()
            if callable(obj):
                obj()
        except PluginError:
            raise
        except Exception as exc:  # a broken third-party plugin must name itself
            raise PluginError(
                f"{label} failed to load: {type(exc).__name__}: {exc}. "
                f"Fix or uninstall the package that provides it."
            ) from exc
        finally:
            _SOURCE.pop()
        log.debug("loaded %s", label)


def reset_for_tests() -> None:
    """Forget that plugins were loaded so the next lookup scans entry points again."""
    global _plugins_loaded
    _plugins_loaded = False
    for reg in (ALGORITHMS, FORMATS, ARCHITECTURES):
        reg._entries = {k: v for k, v in reg._entries.items() if v.source == "quantkit"}
