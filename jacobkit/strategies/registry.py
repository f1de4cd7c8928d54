"""The one registry that names strategies: by name, for ``strategy="..."``,
``auto``'s candidates and the plan cache's JSON.

Member modules may import it (``structured`` looks its inner strategy up by
name): it imports nothing but :mod:`~jacobkit.strategies.base`. The built-in
strategies are registered by :mod:`~jacobkit.strategies.builtin`.
"""

from __future__ import annotations

from typing import Any

from jacobkit.strategies.base import Strategy

REGISTRY: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Add a strategy class under ``cls.name``; a name is registered once."""
    if cls.name in REGISTRY:
        raise ValueError(
            f"strategy {cls.name!r} is already registered "
            f"({REGISTRY[cls.name].__qualname__}); choose another name."
        )
    REGISTRY[cls.name] = cls
    return cls


def names() -> list[str]:
    """Registered strategy names, plus ``"auto"``."""
    return [*REGISTRY, "auto"]


def get(strategy: str | Strategy) -> Strategy:
    """A configured strategy from a name or an instance (returned as is)."""
    if isinstance(strategy, Strategy):
        return strategy
    if isinstance(strategy, str) and strategy in REGISTRY:
        return REGISTRY[strategy]()
    if isinstance(strategy, type) and issubclass(strategy, Strategy):
        raise TypeError(
            f"jacobian(strategy={strategy.__name__}): got the class, not a "
            f"configured instance. Pass strategy={strategy.__name__}() (with "
            f"options if it takes any) or the name {strategy.name!r}."
        )
    raise ValueError(
        f"jacobian(strategy={strategy!r}): unknown strategy. Choose one of "
        f"{', '.join(repr(n) for n in names())}, or pass a configured instance "
        "such as jacobkit.strategies.Chunked(chunk_size=16)."
    )


def to_spec(strategy: Strategy) -> dict[str, Any]:
    """A configured strategy as JSON-friendly data: ``{"name", "options"}``
    (an option that is itself a strategy, as ``Structured(inner=While(5))``,
    as ``{"strategy": its spec}``)."""
    options = {
        key: {"strategy": to_spec(value)} if isinstance(value, Strategy) else value
        for key, value in strategy.options.items()
    }
    return {"name": strategy.name, "options": options}


def from_spec(spec: Any) -> Strategy:
    """The strategy :func:`to_spec` described; ``ValueError`` if ``spec``
    names no registered strategy or options it does not take."""
    if not isinstance(spec, dict) or spec.get("name") not in REGISTRY:
        raise ValueError(f"not a registered strategy: {spec!r}")
    options = spec.get("options") or {}
    if not isinstance(options, dict):
        raise ValueError(f"options of {spec['name']!r} must be a dict: {options!r}")
    options = {
        key: (
            from_spec(value["strategy"])
            if isinstance(value, dict) and set(value) == {"strategy"}
            else value
        )
        for key, value in options.items()
    }
    try:
        return REGISTRY[spec["name"]](**options)
    except TypeError as err:
        raise ValueError(f"bad options for {spec['name']!r}: {err}") from err
