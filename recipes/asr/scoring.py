"""Test-time scoring report with jiwer: WER, substitutions/deletions/insertions, alignments."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jiwer

REPORT_NAME = "wer_report.txt"


def score(references: Sequence[str], hypotheses: Sequence[str]) -> dict[str, float | int]:
    """Corpus-level word error counts (total errors over total reference words)."""
    out = jiwer.process_words(list(references), list(hypotheses))
    ref_words = out.hits + out.substitutions + out.deletions
    return {"wer": out.wer, "substitutions": out.substitutions, "deletions": out.deletions,
            "insertions": out.insertions, "hits": out.hits, "reference_words": ref_words,
            "utterances": len(references)}


def write_report(records: Sequence[tuple[str, str, str]], out_dir: str | Path, *,
                 num_examples: int = 8, title: str = "test",
                 extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Score ``(utt_id, reference, hypothesis)`` records and write the report files.

    Writes into ``out_dir``: ``wer_report.txt`` (summary, the utterances with most errors and
    their word alignments), ``wer.json`` (the numbers, plus the ``extra`` entries), and
    ``hyp.txt``/``ref.txt`` in Kaldi ``text`` format. Returns the numbers (with ``extra``).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    records = sorted(records)
    ids = [r[0] for r in records]
    refs = [r[1] for r in records]
    hyps = [r[2] for r in records]
    numbers: dict[str, Any] = {**score(refs, hyps), **(extra or {})}
    per_utt = jiwer.process_words(refs, hyps)
    errors = [sum(a.ref_end_idx - a.ref_start_idx if a.type in ("substitute", "delete")
                  else a.hyp_end_idx - a.hyp_start_idx if a.type == "insert" else 0
                  for a in chunks) for chunks in per_utt.alignments]
    worst = sorted((i for i in range(len(ids)) if errors[i] > 0), key=lambda i: (-errors[i], i))
    lines = [
        f"{title}: WER {100 * numbers['wer']:.2f}% "
        f"({numbers['substitutions']} substitutions + {numbers['deletions']} deletions + "
        f"{numbers['insertions']} insertions) / {numbers['reference_words']} reference words, "
        f"{numbers['utterances']} utterances, {len(worst)} with errors",
        "",
        f"Utterances with the most errors (up to {num_examples}):",
    ]
    for i in worst[:num_examples]:
        one = jiwer.process_words(refs[i], hyps[i])
        alignment = jiwer.visualize_alignment(one, show_measures=False, skip_correct=False)
        body = alignment.split("\n", 2)[-1].strip("\n")
        lines += ["", f"{ids[i]} ({errors[i]} errors)", body]
    (out_dir / REPORT_NAME).write_text("\n".join(lines) + "\n")
    (out_dir / "wer.json").write_text(json.dumps(numbers, indent=2) + "\n")
    (out_dir / "hyp.txt").write_text("".join(f"{u} {h}\n" for u, h in zip(ids, hyps)))
    (out_dir / "ref.txt").write_text("".join(f"{u} {r}\n" for u, r in zip(ids, refs)))
    return numbers
