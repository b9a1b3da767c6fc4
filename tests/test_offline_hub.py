"""A hub id without a network: hub_extra.hub_model_path asks a faked hub once, briefly; an uncached id stops in
seconds with one line (exit 2), a cached one trains from the cache; tiny names and local paths never ask."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import huggingface_hub.constants
import huggingface_hub.utils
import pytest
from helpers import main_in_process

import common
import gspo
from extras import hub as hub_extra

REPO = "rlref-test/tiny-cached"
TINY_RUN = ["--prompts-per-step", "2", "--group-size", "2", "--minibatches", "1", "--max-new-tokens", "4",
            "--eval-size", "2", "--eval-every", "0", "--steps", "1"]  # fmt: skip


class FakeSession:
    """huggingface_hub's session, as the probe sees it: HEAD hangs (until the test ends), raises, or answers."""

    def __init__(self, mode: str):
        self.mode, self.asked, self.release = mode, [], threading.Event()

    def head(self, url, timeout=None):
        self.asked.append(url)
        if self.mode == "hang":  # a network that drops packets, or a name lookup that never returns
            self.release.wait(60)
            raise OSError("released")
        if self.mode == "refuse":
            raise OSError(-2, "Name or service not known")
        if self.mode == "answer":
            return object()
        raise AssertionError(f"the hub was asked ({url}) where nothing should ask it")


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """Install a FakeSession (set its .mode) and an empty hub cache under tmp_path; undone after the test."""
    session = FakeSession("never")
    monkeypatch.setattr(huggingface_hub.utils, "get_session", lambda: session)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    hub_extra.hub_model_path.cache_clear()
    yield session
    session.release.set()
    hub_extra.hub_model_path.cache_clear()


def cache_tiny(cache: Path, repo: str = REPO) -> Path:
    """The tiny checkpoint as the hub's cache holds a downloaded repo; returns its snapshot directory."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("0123abcd" * 5)
    snapshot = folder / "snapshots" / ("0123abcd" * 5)
    shutil.copytree(common.tiny_checkpoint("tiny"), snapshot)
    return snapshot


def test_an_unreachable_hub_and_an_uncached_model_stop_in_seconds_with_one_line(hub, tmp_path, capsys):
    hub.mode = "refuse"  # first a failure without waiting, so that the time below is not this process's imports
    assert main_in_process(gspo, ["--model", REPO, *TINY_RUN, "--out", tmp_path / "run"], capsys)[0] == 2
    hub_extra.hub_model_path.cache_clear()
    hub.mode, hub.asked = "hang", []
    start = time.perf_counter()
    status, _, err = main_in_process(gspo, ["--model", REPO, *TINY_RUN, "--out", tmp_path / "run"], capsys)
    elapsed = time.perf_counter() - start
    assert status == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: --model {REPO}: cannot reach the hub (https://")
    assert f"no answer in {hub_extra.HUB_PROBE_S:g} s" in err
    assert f"not in the cache {tmp_path / 'hub-cache'}" in err and "HF_HUB_OFFLINE=1" in err
    assert elapsed < 5, f"{elapsed:.1f} s"
    assert len(hub.asked) == 1 and hub.asked[0].endswith(f"/{REPO}/resolve/main/config.json")
    assert not (tmp_path / "run").exists()


def test_a_refused_connection_says_why(hub):
    hub.mode = "refuse"
    with pytest.raises(common.UsageError, match=r"\(https://\S+: OSError: \[Errno -2\] Name or service not known\)"):
        common.load_tokenizer(REPO)


def test_a_cached_model_trains_from_the_cache_without_the_hub(hub, tmp_path, capsys, monkeypatch):
    snapshot = cache_tiny(tmp_path / "hub-cache")
    hub.mode = "hang"
    monkeypatch.setattr(hub_extra, "HUB_PROBE_S", 0.5)  # (the wait itself is the test above's)
    assert common.model_path(REPO) == str(snapshot)
    start = time.perf_counter()
    status, _, err = main_in_process(gspo, ["--model", REPO, *TINY_RUN, "--out", tmp_path / "run"], capsys)
    assert status == 0, err
    assert time.perf_counter() - start < 30  # (the hub's retries alone took ~50 s; the run itself ~1 s)
    assert len(hub.asked) == 1  # asked once per process, for every load (tokenizer, policy, reference)
    assert '"model": "rlref-test/tiny-cached"' in (tmp_path / "run" / "summary.json").read_text()


def test_a_hub_that_answers_leaves_the_id_to_transformers(hub, tmp_path):
    cache_tiny(tmp_path / "hub-cache")  # cached or not: with a network transformers checks it against the hub
    hub.mode = "answer"
    assert common.model_path(REPO) == REPO
    assert common.model_path(REPO) == REPO and len(hub.asked) == 1


def test_hf_hub_offline_asks_nothing(hub, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert common.model_path(REPO) == REPO and hub.asked == []  # transformers reads the cache itself


def test_tiny_names_and_local_directories_never_ask_the_hub(hub, tmp_path):
    local = tmp_path / "Org" / "model"  # a directory shaped like a hub id
    shutil.copytree(common.tiny_checkpoint("tiny"), local)
    for name in ("tiny", str(local)):
        assert common.load_tokenizer(name) is not None
    assert common.model_path(str(local)) == str(local)
    assert hub.asked == []
