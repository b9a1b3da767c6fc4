"""extras/data_files.py: --data and --eval-data, JSONL files of {prompt, answer, ...} records or GSM8K's
{question, answer: "... #### N"}, read with one-line errors naming the file and the line (docs/running.md); and
the check that a tokenizer with an unknown token can represent every character of the files and --system-prompt."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from common import ARITH_EVAL_SEED, TINY_MODELS, UsageError, _clip, arith_split


def jsonl_objects(path: str, flag: str = "--data"):
    """text_objects of a JSONL file; a missing or unreadable file is a UsageError naming `flag` and the file."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{flag} {path}: is a directory, expected a JSONL file")
    if not p.is_file():
        raise UsageError(f"{flag} {path}: file not found")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{flag} {path}: cannot read ({e.__class__.__name__})") from e
    yield from text_objects(text, f"{flag} {path}")


def text_objects(text: str, where: str):
    """(line number, JSON object) for each non-blank line of JSONL `text`; invalid JSON or a line that is
    not an object is a UsageError naming `where` (a flag and file, a URL) and the line."""
    for lineno, line in enumerate(text.split("\n"), 1):  # not splitlines(): JSON strings may hold U+2028
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{where}:{lineno}: invalid JSON ({e.msg})") from e
        if not isinstance(rec, dict):
            raise UsageError(f"{where}:{lineno}: expected a JSON object")
        yield lineno, rec


def gsm8k_final_answer(answer: str) -> str | None:
    """The final answer of a GSM8K solution ("...reasoning...\n#### 1,080"): the text after its last '####',
    stripped ("1,080"); None without one."""
    return answer.rsplit("####", 1)[-1].strip() if "####" in answer else None


def load_jsonl(path: str, flag: str = "--data", needs_answer: bool = True):
    """Records {"prompt", "answer", ...} or GSM8K's {"question", "answer": "... #### N"} (its question the prompt,
    its answer what follows '####'), every other field kept for the reward functions. `needs_answer`: every record
    must have one (the built-in rewards compare against it)."""
    records = []
    for lineno, rec in jsonl_objects(path, flag):
        gsm8k = "question" in rec and "prompt" not in rec  # GSM8K: the gold is what follows '####'
        prompt = rec.pop("question") if gsm8k else rec.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise UsageError(f"{flag} {path}:{lineno}: missing field 'prompt' (or 'question')")
        clash = {"prompts", "completions"} & rec.keys()
        if clash:
            raise UsageError(
                f"{flag} {path}:{lineno}: field '{clash.pop()}' is the name of a reward function's own argument"
            )
        answer = rec.get("answer")
        if isinstance(answer, (int, float)):
            answer = str(answer)
        if needs_answer and (not isinstance(answer, str) or not answer.strip()):
            raise UsageError(f"{flag} {path}:{lineno}: missing field 'answer'")
        if gsm8k and isinstance(answer, str) and (needs_answer or "####" in answer):
            answer = gsm8k_final_answer(answer)
            if answer is None:
                raise UsageError(f"{flag} {path}:{lineno}: field 'answer' has no '#### N' final answer")
        if isinstance(answer, str):
            rec["answer"] = answer.strip()
        records.append({**rec, "prompt": prompt})
    if not records:
        raise UsageError(f"{flag} {path}: no records")
    return records


def unknown_characters(tok, chars) -> set:
    """The characters of `chars` that `tok` turns into its unknown token (none without one: Qwen's)."""
    chars = sorted(set(chars))
    if tok.unk_token_id is None or not chars:
        return set()
    return {c for c, ids in zip(chars, tok(chars, add_special_tokens=False)["input_ids"]) if tok.unk_token_id in ids}


def check_characters(tok, model: str, where: str, records: list[dict]):
    """A UsageError naming the first record whose prompt or answer has characters `tok` turns into its unknown
    token (which decoding drops: a task written in them would train on text the model cannot see)."""
    texts = ["".join([r["prompt"]] + [r["answer"]] * isinstance(r.get("answer"), str)) for r in records]
    bad = unknown_characters(tok, "".join(texts))
    if bad:
        hits = [i for i, t in enumerate(texts) if bad & set(t)]
        first = sorted(bad & set(texts[hits[0]]))
        raise UsageError(
            f"{where}: record {hits[0] + 1} (prompt {_clip(records[hits[0]]['prompt'])}) has characters "
            f"{cannot_represent(tok, model, first)} ({len(hits)} of {len(records)} records have such characters)"
        )


def cannot_represent(tok, model: str, chars) -> str:
    whose = "the tiny model's tokenizer (printable ASCII and newline only)" if model in TINY_MODELS else (
        f"--model {model}'s tokenizer")  # fmt: skip
    listed = ", ".join(f"{c!r} (U+{ord(c):04X})" for c in chars)
    return (f"{whose} cannot represent: {listed}; each would become {tok.unk_token}, which decoding drops "
            "(use characters it knows, or another --model)")  # fmt: skip


def check_system_prompt(tok, model: str, system_prompt: str):
    bad = unknown_characters(tok, system_prompt)
    if bad:
        raise UsageError(f"--system-prompt has characters {cannot_represent(tok, model, sorted(bad))}")


def load_task(data: str | None, eval_data: str | None, eval_fraction: float = 0.1, needs_answer=True, check=None):
    """common.load_task given a file: (train, eval) records, the evaluation set --eval-data's, else a fixed
    `eval_fraction` of --data held out (training: the rest, or the arith task's split without --data)."""
    check = check or (lambda where, records: None)
    held_out = load_jsonl(eval_data, "--eval-data", needs_answer) if eval_data else None
    if held_out is not None:
        check(f"--eval-data {eval_data}", held_out)
    if not data:
        return arith_split()[0], held_out
    records = load_jsonl(data, "--data", needs_answer)
    check(f"--data {data}", records)
    if held_out is not None:
        return records, held_out
    if len(records) < 2:
        raise UsageError(f"--data {data}: needs at least 2 records (a training and a held-out part)")
    order = np.random.RandomState(ARITH_EVAL_SEED).permutation(len(records))
    n_eval = max(1, int(len(records) * eval_fraction))
    return [records[i] for i in order[n_eval:]], [records[i] for i in order[:n_eval]]
