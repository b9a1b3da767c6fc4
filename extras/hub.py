"""extras/hub.py: --model as a checkpoint directory or a hub id (every model but the embedded ones): its name checked
before anything loads, a hub id's source found with one question to the hub (an offline machine fails fast, or loads
the cached snapshot, where huggingface_hub's own retries take about 50 s), a model that does not load one line."""

from __future__ import annotations

import functools
import re
import threading
from pathlib import Path

from common import UsageError, _describe

HUB_PROBE_S = 3.0  # how long a hub id waits for the hub to answer
HUB_ID = r"[A-Za-z0-9][\w.-]*/[\w.-]+"


def check_model_name(model: str):
    """An existing Hugging Face checkpoint directory, or something shaped like a hub id."""
    expected = "expected 'tiny', a checkpoint directory or a hub id like Qwen/Qwen2.5-0.5B"
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UsageError(f"--model {model}: directory has no config.json (not a Hugging Face checkpoint)")
        return
    if path.exists():
        raise UsageError(f"--model {model}: is a file; {expected}")
    # a local path that does not exist ('runs/x/final', './m', '/abs') must not be sent to the hub
    local = model.startswith(("/", ".", "~")) or Path(model.split("/")[0]).is_dir()
    if local or not re.fullmatch(HUB_ID, model):
        raise UsageError(f"--model {model}: no such directory; {expected}")


def model_path(name: str, ask_hub: bool = True) -> str:
    """common.model_path of a local directory (itself) or a hub id (its source; the id itself without ask_hub)."""
    if not ask_hub or Path(name).expanduser().exists() or not re.fullmatch(HUB_ID, name):
        return name
    return hub_model_path(name)


def from_pretrained(auto, name: str, path: str, **kwargs):
    """`auto`.from_pretrained(path): a --model that does not load is one line (exit 2), not a traceback."""
    try:
        return auto.from_pretrained(path, **kwargs)
    except Exception as e:
        raise UsageError(f"--model {name}: cannot load it ({_describe(e)})") from e


@functools.cache  # one question to the hub per model and process
def hub_model_path(name: str) -> str:
    """A hub id's source: `name` itself when the hub answers one HEAD request within HUB_PROBE_S seconds, or under
    HF_HUB_OFFLINE=1; else its snapshot in the local cache; not cached, a UsageError saying how to go offline."""
    from huggingface_hub import constants, hf_hub_url, try_to_load_from_cache
    from huggingface_hub.utils import get_session

    if constants.HF_HUB_OFFLINE:
        return name
    url, answer = hf_hub_url(name, "config.json"), []

    def head():  # any HTTP status, even 401 / 404, means the hub is there: transformers then says the rest
        try:
            get_session().head(url, timeout=HUB_PROBE_S)
            answer.append(None)
        except Exception as e:
            answer.append(_describe(e))

    probe = threading.Thread(target=head, daemon=True)  # a thread: name resolution has no timeout of its own
    probe.start()
    probe.join(HUB_PROBE_S)
    if answer and answer[0] is None:
        return name
    cached = try_to_load_from_cache(name, "config.json")
    if isinstance(cached, str):  # offline, with the model in the cache: load the snapshot, no retries
        return str(Path(cached).parent)
    why = answer[0] if answer else f"no answer in {HUB_PROBE_S:g} s"
    raise UsageError(
        f"--model {name}: cannot reach the hub ({constants.ENDPOINT}: {why}) and the model is not in the cache "
        f"{constants.HF_HUB_CACHE}; connect, or download it where there is a network and set HF_HUB_OFFLINE=1"
    )
