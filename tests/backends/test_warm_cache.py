"""The warm-restart store (``backends/warm_cache.py``): its files are unpickled only when this user alone
may have written them."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from ppcompile import envs
from ppcompile.backends import warm_cache

pytestmark = pytest.mark.skipif(not hasattr(os, "getuid"), reason="user ids are POSIX")

KEY = "0" * 32
ENTRIES = [(b"stored compile", {"some_model": None})]


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PPCOMPILE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _written() -> Path:
    path = warm_cache.write_entries(KEY, ENTRIES)
    assert path is not None
    return path


def test_the_store_is_made_private_and_its_files_read_back() -> None:
    path = _written()
    assert stat.S_IMODE(path.parent.stat().st_mode) & 0o077 == 0
    assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0
    assert envs.untrusted_reason(path) is None
    assert warm_cache.read_entries(KEY) == ENTRIES


@pytest.mark.parametrize("which", ["directory", "file"])
def test_a_store_others_may_write_is_not_loaded(which: str, caplog: pytest.LogCaptureFixture) -> None:
    path = _written()
    target = path.parent if which == "directory" else path
    os.chmod(target, stat.S_IMODE(target.stat().st_mode) | stat.S_IWOTH)
    with caplog.at_level(logging.WARNING, logger=warm_cache.__name__):
        assert warm_cache.read_entries(KEY) == []
    assert f"{target} may be written by other users" in caplog.text
    assert "chmod -R go-w" in caplog.text
    os.chmod(target, stat.S_IMODE(target.stat().st_mode) & ~stat.S_IWOTH)
    assert warm_cache.read_entries(KEY) == ENTRIES  # the fix the warning names is enough


def test_a_file_of_another_user_is_not_loaded(monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    path = _written()
    mine = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: mine + 1)  # the store now looks another user's
    with caplog.at_level(logging.WARNING, logger=warm_cache.__name__):
        assert warm_cache.read_entries(KEY) == []
    assert f"belongs to uid {mine}, not to this process's user ({mine + 1})" in caplog.text
    assert path.read_bytes()  # refused, not deleted


def test_a_missing_file_is_a_quiet_miss(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=warm_cache.__name__):
        assert warm_cache.read_entries(KEY) == []
    assert caplog.text == ""
