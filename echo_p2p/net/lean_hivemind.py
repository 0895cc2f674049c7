"""hivemind's DHT, P2P and record validators without torch: lazy stand-ins for hivemind's package ``__init__``s.

Importing any hivemind module runs ``hivemind/__init__.py``, which imports the averagers, the optimizer and the
mixture-of-experts (torch, scipy: ~1 s and ~1,700 modules), and ``hivemind.utils`` and ``hivemind.dht``,
whose ``__init__``s import torch for ``MPFuture`` and ``TensorDescriptor``. The DHT node itself
(``hivemind.dht.node``), libp2p (``hivemind.p2p``), the validators and the serializer need none of it.

``use_lean_hivemind()`` puts a stand-in for each of those package ``__init__``s in ``sys.modules`` before the
first hivemind import: a module with the package's search path (its submodules import as usual) whose names
(``hivemind.DHT``, ``hivemind.utils.get_dht_time``...) resolve on first use to the very objects the real
``__init__`` would have imported, read from its ``from X import Y`` lines. Nothing is lost: a process that
later uses ``hivemind.Optimizer`` imports it (and torch) then. Callers: the processes that never train —
the bootstrap, ``swarm status``, the monitor — before anything imports hivemind; it does nothing where hivemind
is already imported. Must not import hivemind itself.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
import types

#: The package ``__init__``s that import torch, parents first (``hivemind.p2p``'s does not: it stays real).
LEAN_PACKAGES = ("hivemind", "hivemind.utils", "hivemind.dht")


def use_lean_hivemind() -> bool:
    """Install the stand-ins; True when they are in place, False when hivemind was already imported (then
    the real package stays: mixing the two is never done)."""
    if "hivemind" in sys.modules:
        return isinstance(sys.modules["hivemind"], LeanPackage)
    for name in LEAN_PACKAGES:
        module = LeanPackage(name)
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
    return True


class LeanPackage(types.ModuleType):
    """A package whose ``__init__`` is read, not run: its ``from X import Y`` names are imported on first use."""

    def __init__(self, name: str) -> None:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None or spec.submodule_search_locations is None:
            raise ImportError(f"{name} is not an installed package")
        tree = ast.parse(open(spec.origin, encoding="utf-8").read(), filename=spec.origin)
        super().__init__(name, ast.get_docstring(tree))
        self.__path__ = list(spec.submodule_search_locations)
        self.__file__ = spec.origin
        self.__spec__ = spec
        self.__package__ = name
        self._lean_names: dict[str, tuple[str, str]] = {}
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    self._lean_names[alias.asname or alias.name] = (node.module, alias.name)
            elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                for target in node.targets:  # e.g. __version__ = "1.1.12"
                    if isinstance(target, ast.Name):
                        setattr(self, target.id, node.value.value)

    def __getattr__(self, attr: str):
        names = self.__dict__.get("_lean_names", {})
        if attr not in names:
            raise AttributeError(f"module {self.__name__!r} has no attribute {attr!r}")
        module, name = names[attr]
        value = getattr(importlib.import_module(module), name)
        setattr(self, attr, value)
        return value
