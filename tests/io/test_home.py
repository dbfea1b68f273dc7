"""``io.home``: this user's home and ``~`` in path settings, as one-line refusals where there is none (issue 68, item 10).

``os.path.expanduser`` leaves ``~nosuchuser/x`` relative and ``Path.expanduser`` raises ``RuntimeError`` for it, or for
any ``~`` of an arbitrary UID without ``HOME`` (OpenShift): every expansion of marlin-pack goes through ``io.home``.
"""

from __future__ import annotations

import os
import pwd
import re
from pathlib import Path

import pytest

from marlin_pack.io.home import HomeDirectoryError, expand_user, home_dir
from marlin_pack.io.stamps import STAMPS_ENV, StampStore, stamps_dir


@pytest.fixture
def no_passwd(monkeypatch: pytest.MonkeyPatch) -> None:
    """An arbitrary UID, as OpenShift runs containers: no passwd entry (and, per test, no HOME)."""
    def missing(uid: int) -> object:
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(pwd, "getpwuid", missing)


def test_expand_user() -> None:
    home = Path(pwd.getpwuid(os.getuid()).pw_dir)
    assert expand_user("/abs/x", "V") == Path("/abs/x") and expand_user("rel/x", "V") == Path("rel/x")
    assert expand_user("~/x", "V", {"HOME": "/h"}) == Path("/h/x") and expand_user("~", "V", {"HOME": "/h"}) == Path("/h")
    assert expand_user(f"~{pwd.getpwuid(os.getuid()).pw_name}/x", "V") == home / "x"
    with pytest.raises(HomeDirectoryError, match=r"^V is '~nosuchuser/x', whose ~ cannot be expanded: there is no user "
                       r"'nosuchuser' on this host; use an absolute path for V$"):
        expand_user("~nosuchuser/x", "V")
    with pytest.raises(HomeDirectoryError, match=r"V is '~/x', .*HOME is 'relative', not an absolute path"):
        expand_user("~/x", "V", {"HOME": "relative"})


def test_no_home_directory(no_passwd: None) -> None:
    with pytest.raises(HomeDirectoryError, match=rf"^V is '~/x', whose ~ cannot be expanded: HOME is unset and uid {os.getuid()} "
                       "has no home in the passwd database; use an absolute path for V$"):
        expand_user("~/x", "V", {})
    with pytest.raises(HomeDirectoryError, match=re.escape("the cache defaults to a folder under the home directory, but HOME is "
                                                           "empty") + ".*; set C to an absolute path$"):
        home_dir("the cache", "C", {"HOME": ""})
    assert home_dir("the cache", "C", {"HOME": "/h"}) == Path("/h")


def test_stamps_without_a_home_or_with_a_tilde_that_names_none(no_passwd: None) -> None:
    """No home: no stamps (every check hashes, and says why); ``MARLIN_PACK_STAMPS=~x/...``: the same, naming the variable."""
    assert stamps_dir({}) is None and stamps_dir({"HOME": "relative"}) is None
    assert stamps_dir({"HOME": "/h"}) == Path("/h/.cache/marlin-pack/stamps")
    with pytest.raises(HomeDirectoryError, match=f"{STAMPS_ENV} is '~nosuchuser/s'"):
        stamps_dir({STAMPS_ENV: "~nosuchuser/s"})
    for env in ({STAMPS_ENV: "~nosuchuser/s"}, {STAMPS_ENV: "~/s"}):
        with StampStore.open(env) as store:
            assert store.where is None and store.unavailable is not None and STAMPS_ENV in store.unavailable
            assert f"{STAMPS_ENV} is {env[STAMPS_ENV]!r}" in store.unavailable
