"""tools/gsm8k.py: GSM8K as published, turned into the files --data and --eval-data read.

    python tools/gsm8k.py                  # downloads both splits from GitHub, writes data/gsm8k_{train,test}.jsonl
    python tools/gsm8k.py --from DIR       # the same from DIR/train.jsonl and DIR/test.jsonl, already downloaded
    python grpo.py --data data/gsm8k_train.jsonl --eval-data data/gsm8k_test.jsonl ...

GSM8K is published in openai/grade-school-math as grade_school_math/data/train.jsonl (7,473 records) and
test.jsonl (1,319), one {"question": ..., "answer": "...reasoning...\\n#### 72"} a line; the Hugging Face
dataset openai/gsm8k (config "main") holds the same records. Each becomes {"prompt": question, "answer":
the number after '#### '}, normalised as the reward compares it (common.normalize_number: "1,080" ->
"1080"; 93 of the published answers have a thousands separator, 5 are negative, none has a decimal
point). The reasoning is dropped: the built-in rewards read only the final answer.

Every record of both splits is checked before anything is written: a line that is not a JSON object,
a record without a question, or an answer whose last line is not '#### <number>' stops with one line
naming the file (or URL) and the line, exit status 2, and no output file is created or changed. Each
output is written whole (a temporary file, then renamed); an earlier output is replaced.

The download (urllib, no other dependency) has not been run where this was written, which had no
network; a failed download is one line naming the URL and suggesting --from, exit status 2. The
conversion (--from) is tested on records in the published form: tests/test_gsm8k_tool.py.
"""

import json
import os
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py, when run as a script

from cli import ArgumentParser  # noqa: E402

from common import UsageError, _describe, die, normalize_number  # noqa: E402
from extras.data_files import gsm8k_final_answer, jsonl_objects, text_objects  # noqa: E402

SPLITS = ("train", "test")
URL = "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/{split}.jsonl"
OUT_NAME = "gsm8k_{split}.jsonl"
UMASK = os.umask(0o022)
os.umask(UMASK)


def convert(objects, where: str) -> list[dict]:
    """{"prompt", "answer"} records from (line number, GSM8K record) pairs; UsageError naming `where` and
    the line for a record without a question or whose answer does not end in a '#### <number>' line."""
    records = []
    for lineno, rec in objects:
        question, answer = rec.get("question"), rec.get("answer")
        if not isinstance(question, str) or not question.strip():
            raise UsageError(f"{where}:{lineno}: no 'question' (a GSM8K record is {{question, answer}})")
        if not isinstance(answer, str) or not answer.rstrip("\n").split("\n")[-1].startswith("#### "):
            raise UsageError(f"{where}:{lineno}: the 'answer' does not end in a '#### <number>' line")
        number = normalize_number(gsm8k_final_answer(answer))
        if number is None:
            raise UsageError(f"{where}:{lineno}: the answer's '#### ' line is not a number: {answer[-40:]!r}")
        records.append({"prompt": question, "answer": number})
    if not records:
        raise UsageError(f"{where}: no records")
    return records


def download(url: str, timeout: float = 60) -> str:
    """The text at `url`; a failure is a UsageError naming the URL and --from."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.read().decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:  # (urllib's URLError and HTTPError are OSErrors)
        raise UsageError(
            f"cannot download {url} ({_describe(e)}); download train.jsonl and test.jsonl "
            "(openai/grade-school-math, grade_school_math/data/) and run python tools/gsm8k.py --from DIR"
        ) from e


def read_splits(source: str | None) -> dict:
    """{split: records} of both splits, from DIR/<split>.jsonl (--from) or downloaded."""
    if source is not None:
        if not Path(source).is_dir():
            raise UsageError(f"--from {source}: not a directory (expected one holding train.jsonl and test.jsonl)")
        files = {s: str(Path(source) / f"{s}.jsonl") for s in SPLITS}
        return {s: convert(jsonl_objects(path, "--from"), f"--from {path}") for s, path in files.items()}
    splits = {}
    for s in SPLITS:
        url = URL.format(split=s)
        splits[s] = convert(text_objects(download(url), url), url)
    return splits


def write_splits(out: Path, splits: dict) -> list[Path]:
    """Each split's records as JSONL at out/gsm8k_<split>.jsonl, all whole or none: every file is written
    to a temporary file beside it first, and the temporary files are renamed only once all are written."""
    done, paths = [], []
    try:
        for split, records in splits.items():
            fd, tmp = tempfile.mkstemp(dir=out, prefix=f".gsm8k_{split}.", suffix=".tmp")
            done.append(tmp)
            os.chmod(tmp, 0o666 & ~UMASK)  # (mkstemp's file is private: the output is an ordinary file)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)
        for tmp, split in zip(done, splits):
            paths.append(out / OUT_NAME.format(split=split))
            os.replace(tmp, paths[-1])
    finally:
        for tmp in done:
            Path(tmp).unlink(missing_ok=True)
    return paths


def main(argv=None) -> None:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--from", dest="source", metavar="DIR", help="read DIR/train.jsonl and DIR/test.jsonl (default: "
                   "download them from openai/grade-school-math on GitHub)")  # fmt: skip
    p.add_argument("--out-dir", default="data", help="where gsm8k_train.jsonl and gsm8k_test.jsonl go (default: data)")
    a = p.parse_args(argv)
    try:
        out = Path(a.out_dir)
        if out.exists() and not out.is_dir():
            raise UsageError(f"--out-dir {a.out_dir}: is a file, expected a directory")
        splits = read_splits(a.source)  # every record checked before anything is written
        out.mkdir(parents=True, exist_ok=True)
        for path, records in zip(write_splits(out, splits), splits.values()):
            print(f"{path}: {len(records)} records")
    except UsageError as e:
        die(str(e))
    except OSError as e:  # a directory that cannot be created or written
        die(f"--out-dir {a.out_dir}: cannot write ({_describe(e)})")


if __name__ == "__main__":
    main()
