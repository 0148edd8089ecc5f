"""What every framework adapter shares: the framework's installed version, checked against the releases the
adapter was written for, and the error an adapter raises when it refuses."""

from __future__ import annotations

import os
from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version


class IntegrationError(RuntimeError):
    """An adapter refused: an unknown framework release, or a call it cannot make safe (state unchanged)."""


def installed_version(distribution: str) -> Version | None:
    """The installed release of ``distribution``, or None when it is not installed."""
    try:
        return Version(metadata.version(distribution))
    except metadata.PackageNotFoundError:
        return None
    except InvalidVersion:
        return None


def require_framework(framework: str, distribution: str, known: str, *, allow_env: str | None = None) -> Version:
    """Return the installed release of ``distribution`` when it is within ``known`` (a PEP 440 specifier set),
    else raise :class:`IntegrationError` naming the versions the adapter knows.

    ``allow_env`` names an environment variable that, set to ``1``, accepts any release (the user takes the
    risk); the refusal message names it."""
    got = installed_version(distribution)
    if got is None:
        raise IntegrationError(f"{framework}: the distribution {distribution!r} is not installed")
    if got in SpecifierSet(known):
        return got
    if allow_env and os.environ.get(allow_env) == "1":
        return got
    hint = f"; set {allow_env}=1 to try it anyway" if allow_env else ""
    raise IntegrationError(
        f"{framework} {got} is not a release this adapter knows ({distribution}{known}){hint}")
