"""The one config hook: ordered contributors around ``EngineArgs.create_engine_config``.

``create_engine_config(self, usage_context=None, headless=False)`` has the same signature in vLLM 0.20,
0.25 and 0.32 and is reached by ``LLM(...)``, ``AsyncLLM.from_engine_args`` and ``vllm serve`` alike; it
runs in process 0, whose ``VllmConfig`` is then sent to the engine core and workers. Patches never wrap
it themselves: they register a :class:`Contributor`, and the hook runs all contributors in order on the
``EngineArgs`` instance before vLLM builds the config.

For every setting a contributor touches, a :class:`Setting` records the effective value and where it came
from: ``user`` (passed explicitly; the plugin never overrides it), ``plugin`` (changed by a patch) or
``stock`` (vLLM's own default, left alone). Each decision is logged once per process; ``doctor --model``
shows them.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any, Callable

from vllm_rlpatch import _wrapping
from vllm_rlpatch.hooks import explicit

logger = logging.getLogger("vllm.rlpatch")

OWNER = "config_hook"
TARGET = "vllm.engine.arg_utils:EngineArgs.create_engine_config"


@dataclasses.dataclass
class Setting:
    field: str
    value: Any
    source: str  # "user" | "plugin" | "stock"
    owner: str  # the patch that looked at it
    stock: Any
    reason: str
    detection: str = ""  # how explicitness was determined

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k in ("value", "stock"):
            if not isinstance(d[k], (str, int, float, bool, type(None), list, dict)):
                d[k] = repr(d[k])
        return d


class ConfigContext:
    """What a contributor sees: the engine args, explicitness, and a place to record decisions."""

    def __init__(self, engine_args: Any) -> None:
        self.engine_args = engine_args
        self.settings: dict[str, Setting] = {}

    def explicit(self, name: str) -> tuple[bool, str]:
        return explicit.is_explicit(self.engine_args, name)

    def stock(self, name: str) -> Any:
        return explicit.stock_default(type(self.engine_args), name)

    def propose(self, name: str, value: Any, *, owner: str, reason: str,
                user_consequence: str | None = None, none_is_unset: bool = False) -> Setting:
        """Set ``name`` to ``value`` unless the user passed it explicitly.

        ``user_consequence``: logged once as a WARNING when an explicit user value differs from the
        plugin's (what the user gives up for RL by keeping it). ``none_is_unset``: an explicit ``None``
        counts as not set (``vllm.LLM`` passes some of its own parameters, e.g. ``kv_cache_memory_bytes``,
        as ``None`` whatever the user wrote)."""
        is_user, how = self.explicit(name)
        current = getattr(self.engine_args, name)
        if is_user and none_is_unset and current is None:
            is_user, how = False, how + "; None counts as unset"
        stock = self.stock(name)
        if is_user:
            s = Setting(name, current, "user", owner, stock, "passed explicitly; the plugin leaves it", how)
            if current != value and user_consequence:
                warn_once(("user", name, repr(current)),
                           "vllm-rlpatch: %s=%r was set explicitly and is kept; %s", name, current,
                           user_consequence)
        elif current == value and value == stock:
            s = Setting(name, current, "stock", owner, stock, reason, how)
        else:
            setattr(self.engine_args, name, value)
            s = Setting(name, value, "plugin", owner, stock, reason, how)
        self.settings[name] = s
        return s

    def keep(self, name: str, *, owner: str, reason: str) -> Setting:
        """Record a setting the contributor inspected and left as it is."""
        is_user, how = self.explicit(name)
        current = getattr(self.engine_args, name)
        s = Setting(name, current, "user" if is_user else "stock", owner, self.stock(name), reason, how)
        self.settings[name] = s
        return s


@dataclasses.dataclass(frozen=True)
class Contributor:
    name: str  # owning patch
    order: int
    fn: Callable[[Any, ConfigContext], None]


_LOCK = threading.RLock()
_CONTRIBUTORS: dict[str, Contributor] = {}
_LAST: dict[str, Setting] = {}
_BY_ARGS: dict[int, dict[str, Setting]] = {}
_warned: set[Any] = set()
_logged: set[Any] = set()


def warn_once(key: Any, msg: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(msg, *args)


def _hook(wrapped, instance, args, kwargs):
    with _LOCK:
        contributors = sorted(_CONTRIBUTORS.values(), key=lambda c: (c.order, c.name))
    ctx = ConfigContext(instance)
    for c in contributors:
        c.fn(instance, ctx)
    config = wrapped(*args, **kwargs)
    with _LOCK:
        _LAST.clear()
        _LAST.update(ctx.settings)
        _BY_ARGS[id(instance)] = dict(ctx.settings)
    for s in ctx.settings.values():
        key = (s.field, repr(s.value), s.source)
        if key not in _logged:
            _logged.add(key)
            logger.info("vllm-rlpatch: %s=%r (%s, %s: %s)", s.field, s.value, s.source, s.owner, s.reason)
    return config


def add_contributor(c: Contributor) -> None:
    """Register (idempotent per name) and make sure the hook is installed."""
    with _LOCK:
        _CONTRIBUTORS[c.name] = c
        explicit.install()
        _wrapping.wrap(TARGET, _hook, OWNER)


def remove_contributor(name: str) -> None:
    with _LOCK:
        _CONTRIBUTORS.pop(name, None)
        if not _CONTRIBUTORS:
            _wrapping.unwrap(TARGET, OWNER)
            explicit.uninstall()


def last_settings() -> dict[str, Setting]:
    """Settings decided by the most recent ``create_engine_config`` in this process."""
    with _LOCK:
        return dict(_LAST)


def settings_for(engine_args: Any) -> dict[str, Setting]:
    with _LOCK:
        return dict(_BY_ARGS.get(id(engine_args), {}))
