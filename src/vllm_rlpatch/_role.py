"""Which vLLM process this is (``frontend``, ``engine_core``, ``worker``, ``cli``, ``forked:<role>``, ...).

A leaf of the core: the plugin (:mod:`vllm_rlpatch.plugin`) detects the role when vLLM loads it and sets it
here; patches and the refit layer read it without importing the composition root.
"""

_role = "unknown"


def get() -> str:
    return _role


def set(role: str) -> None:  # noqa: A001 - module-level setter, read as ``_role.set(...)``
    global _role
    _role = role
