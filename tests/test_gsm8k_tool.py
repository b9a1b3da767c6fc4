"""tools/gsm8k.py on GSM8K records as published (tests/data/gsm8k: copied byte for byte from openai/grade-school-math,
MIT License; train.jsonl lines 1, 2, 346, 5716 and test.jsonl lines 1, 147, 490)."""

from __future__ import annotations

import io
import json
import urllib.error
import urllib.request
from pathlib import Path

import gsm8k
import pytest
from helpers import in_process

import common

FIXTURE = Path(__file__).resolve().parent / "data" / "gsm8k"

# The expected records, by hand: each question as published, the answer the number after '#### ' as a
# reward compares it ("1,080" and "1080" are the same number; the output holds the separator-free one)
TRAIN_ANSWERS = ["72", "10", "1080", "-7"]
TEST_ANSWERS = ["18", "2125", "-10"]
TRAIN_PROMPT_STARTS = ["Natalia sold clips to 48", "Weng earns $12 an hour", "Adam earns $40 daily",
                       "Three days' temperatures were recorded"]  # fmt: skip
TEST_PROMPT_STARTS = ["Janet\u2019s ducks lay 16 eggs", "Johnny is picking up the toys", "The highest temperature"]


def run_tool(argv, capsys) -> tuple:
    """tools/gsm8k.py's main in this process: (exit status, stdout, stderr)."""
    return in_process(gsm8k.main, argv, capsys)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def published_questions(split: str) -> list[str]:
    return [json.loads(line)["question"] for line in (FIXTURE / f"{split}.jsonl").read_text().splitlines()]


def check_records(records, starts, answers, questions):
    assert [r["answer"] for r in records] == answers
    assert all(r["prompt"].startswith(s) for r, s in zip(records, starts, strict=True))
    assert [r["prompt"] for r in records] == questions  # the question whole, not cut or stripped
    assert all(set(r) == {"prompt", "answer"} for r in records)  # the reasoning is not kept


def test_published_records_become_what_data_and_eval_data_read(tmp_path, capsys):
    status, out, err = run_tool(["--from", FIXTURE, "--out-dir", tmp_path / "data"], capsys)
    assert status == 0, err
    train_file, test_file = tmp_path / "data" / "gsm8k_train.jsonl", tmp_path / "data" / "gsm8k_test.jsonl"
    assert out.splitlines() == [f"{train_file}: 4 records", f"{test_file}: 3 records"]
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["gsm8k_test.jsonl", "gsm8k_train.jsonl"]
    train, held_out = common.load_task(str(train_file), str(test_file))  # --data, --eval-data
    check_records(train, TRAIN_PROMPT_STARTS, TRAIN_ANSWERS, published_questions("train"))
    check_records(held_out, TEST_PROMPT_STARTS, TEST_ANSWERS, published_questions("test"))
    # the reward reads a completion's number after '####' against it, with or without the separator
    assert common.score("300 + 780 = 1,080\n#### 1,080", train[2]["answer"]) == (1.0, 1.0)
    assert common.score("#### 1080", train[2]["answer"]) == (1.0, 1.0)
    assert common.score("#### -7", train[3]["answer"]) == (1.0, 1.0)
    assert common.score("#### 7", train[3]["answer"]) == (0.0, 1.0)


def test_a_decimal_answer_is_normalised_as_the_reward_compares_it(tmp_path, capsys):
    # (the published splits have no decimal final answer; a record in their form with one)
    for split in ("train", "test"):
        rec = {"question": "Half of 1.5?", "answer": "1.5 / 2 = <<1.5/2=0.75>>0.75\n#### 0.750"}
        (tmp_path / f"{split}.jsonl").write_text(json.dumps(rec) + "\n")
    assert run_tool(["--from", tmp_path, "--out-dir", tmp_path / "out"], capsys)[0] == 0
    assert read_jsonl(tmp_path / "out" / "gsm8k_train.jsonl") == [{"prompt": "Half of 1.5?", "answer": "0.75"}]


BAD_LINES = {
    "not JSON": ('{"question": "How many?", "answer": "#### 3"', "invalid JSON"),
    "not an object": ('["How many?", "#### 3"]', "expected a JSON object"),
    "no question": ('{"answer": "1 + 2 = 3\\n#### 3"}', "no 'question'"),
    "no #### line": ('{"question": "How many?", "answer": "1 + 2 = 3"}', "does not end in a '#### <number>' line"),
    "#### not last": ('{"question": "How many?", "answer": "#### 3\\nso 3"}', "does not end in a '#### <number>' line"),
    "not a number": ('{"question": "How many?", "answer": "so\\n#### three"}', "is not a number"),
}


@pytest.mark.parametrize("case", BAD_LINES)
def test_a_malformed_record_names_file_and_line_and_writes_nothing(tmp_path, capsys, case):
    line, reason = BAD_LINES[case]
    source = tmp_path / "src"
    source.mkdir()
    (source / "train.jsonl").write_bytes((FIXTURE / "train.jsonl").read_bytes())  # a good split first
    test = (FIXTURE / "test.jsonl").read_text().splitlines()
    (source / "test.jsonl").write_text("\n".join([test[0], "", line, test[1]]) + "\n")  # the bad record: line 3
    out = tmp_path / "data"
    out.mkdir()
    (out / "gsm8k_train.jsonl").write_text("earlier\n")  # an earlier output is left as it was
    status, stdout, err = run_tool(["--from", source, "--out-dir", out], capsys)
    assert status == 2 and stdout == ""
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert f"{source / 'test.jsonl'}:3: " in err and reason in err
    assert sorted(p.name for p in out.iterdir()) == ["gsm8k_train.jsonl"]  # no test split, no temporary file
    assert (out / "gsm8k_train.jsonl").read_text() == "earlier\n"


def test_a_missing_split_is_one_line(tmp_path, capsys):
    (tmp_path / "train.jsonl").write_bytes((FIXTURE / "train.jsonl").read_bytes())
    status, _, err = run_tool(["--from", tmp_path, "--out-dir", tmp_path / "out"], capsys)
    assert status == 2 and err == f"error: --from {tmp_path / 'test.jsonl'}: file not found\n"
    assert not (tmp_path / "out").exists()


def test_download_reads_both_published_files(tmp_path, capsys, monkeypatch):
    # the download path with urlopen answering from the fixture (no network where this runs): the same output
    asked = []

    def urlopen(url, timeout):
        asked.append(url)
        return io.BytesIO((FIXTURE / url.rsplit("/", 1)[1]).read_bytes())

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    assert run_tool(["--out-dir", tmp_path], capsys)[0] == 0
    base = "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/"
    assert asked == [base + "train.jsonl", base + "test.jsonl"]
    check_records(read_jsonl(tmp_path / "gsm8k_train.jsonl"), TRAIN_PROMPT_STARTS, TRAIN_ANSWERS,
                  published_questions("train"))  # fmt: skip
    check_records(read_jsonl(tmp_path / "gsm8k_test.jsonl"), TEST_PROMPT_STARTS, TEST_ANSWERS,
                  published_questions("test"))  # fmt: skip


def test_a_failed_download_names_the_url_and_from(tmp_path, capsys, monkeypatch):
    def urlopen(url, timeout):
        raise urllib.error.URLError(OSError(-2, "Name or service not known"))

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    status, _, err = run_tool(["--out-dir", tmp_path / "out"], capsys)
    assert status == 2 and err.count("\n") == 1
    assert err.startswith("error: cannot download https://raw.githubusercontent.com/openai/grade-school-math/")
    assert "train.jsonl" in err and "--from DIR" in err
    assert not (tmp_path / "out").exists()
