"""This user's home directory, and ``~`` in path settings, with a one-line refusal where there is none.

``os.path.expanduser`` leaves ``~nosuchuser/x`` as it is (a relative path into the working directory)
and, for a user without ``HOME`` and without a passwd entry (an arbitrary UID, as OpenShift runs
containers), leaves ``~`` itself; ``Path.expanduser`` and ``Path.home`` raise ``RuntimeError`` there
(``KeyError`` from ``pwd`` on some Pythons). Every path setting marlin-pack expands goes through
:func:`expand_user`, every default under the home directory through :func:`home_dir`: an absolute
path, or a :class:`HomeDirectoryError` naming the variable, what it held and what to set instead.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from marlin_pack.errors import MarlinPackError

__all__ = ["HomeDirectoryError", "home_dir", "expand_user"]


class HomeDirectoryError(MarlinPackError):
    """A path setting whose ``~`` names no home directory, or a default under a home directory this user lacks."""


def _passwd_home(user: str | None) -> str | None:
    """The passwd entry's home of ``user`` (None: the real uid's), or None where there is none."""
    try:
        import pwd

        entry = pwd.getpwuid(os.getuid()) if user is None else pwd.getpwnam(user)
    except (ImportError, KeyError, OSError, OverflowError, ValueError):
        return None
    return entry.pw_dir


def _home(environ: Mapping[str, str]) -> tuple[str | None, str]:
    """(this user's home, absolute; else None) and, for None, why there is none."""
    home = environ.get("HOME")
    if home:
        return (home, "") if os.path.isabs(home) else (None, f"HOME is {home!r}, not an absolute path")
    found = _passwd_home(None)
    if found and os.path.isabs(found):
        return found, ""
    return None, f"HOME is {'empty' if home == '' else 'unset'} and uid {os.getuid()} has no home in the passwd database"


def home_dir(needed_for: str, instead: str, environ: Mapping[str, str] | None = None) -> Path:
    """This user's home directory: ``$HOME`` (absolute), else the passwd entry's.

    Args:
        needed_for: what defaults to a folder under it (e.g. ``the Hugging Face cache``), for the message.
        instead: the variable to set instead (e.g. ``HF_HOME``), for the message.

    Raises:
        HomeDirectoryError: there is none.
    """
    home, why = _home(os.environ if environ is None else environ)
    if home is None:
        raise HomeDirectoryError(
            f"{needed_for} defaults to a folder under the home directory, but {why}; set {instead} to an absolute path"
        )
    return Path(home)


def expand_user(value: str, variable: str, environ: Mapping[str, str] | None = None) -> Path:
    """``value`` (the setting ``variable``) with a leading ``~`` or ``~user`` expanded; anything else as given.

    Raises:
        HomeDirectoryError: the ``~`` names no home directory (no such user, or this user has none).
    """
    if not value.startswith("~"):
        return Path(value)
    head, sep, rest = value[1:].partition("/")
    if head:
        home, why = _passwd_home(head), f"there is no user {head!r} on this host"
        if home is not None and not os.path.isabs(home):
            home, why = None, f"user {head!r} has the home {home!r}, not an absolute path"
    else:
        home, why = _home(os.environ if environ is None else environ)
    if home is None:
        raise HomeDirectoryError(f"{variable} is {value!r}, whose ~ cannot be expanded: {why}; use an absolute path for {variable}")
    return Path(home) / rest if sep and rest else Path(home)
