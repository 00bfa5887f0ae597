"""Records make the docs: the race parts of docs/choosing.md and docs/races.md, the demo's parity
table of docs/benchmarks.md and the README's results sentence are what
``benchmarks/race/docs.py`` generates from ``benchmarks/results/`` (regenerate with
``python -m benchmarks.race.docs``).

Also: the generated text claims no speed-up while no fair record exists, lists every withdrawn
record, and renders a fair record's claims only where ``rules.score`` allows them.
"""

from __future__ import annotations

from benchmarks.race import docs
from testbed.launch import ROOT
from tests.test_race_rules import fair_record


def test_committed_docs_equal_the_generated_text() -> None:
    parts = docs.generated()
    rendered = {rel: docs.render(ROOT / rel, parts) for rel in docs.TARGETS}
    for rel in ("docs/choosing.md", "docs/races.md", "docs/benchmarks.md", "README.md"):
        assert rendered[rel] is not None, f"{rel} lost its generated part's markers"
    stale = [rel for rel, text in rendered.items()
             if text is not None and text != (ROOT / rel).read_text()]
    assert stale == [], f"run `python -m benchmarks.race.docs`: {stale} differ from the records"


def test_without_fair_records_nothing_is_claimed_and_every_old_race_is_withdrawn() -> None:
    withdrawn = docs.withdrawn_records()
    text = " ".join(docs.race_part([], withdrawn).split())
    assert "no speed-up is claimed" in text and "withdrawn" in text and docs.WITHDRAWN in text
    table = docs.withdrawn_table(withdrawn)
    for name, _ in withdrawn:
        assert f"`{name}`" in table
    assert "x ddp" not in text and "faster" not in text
    sentence = " ".join(docs.results_sentence([]).split())
    assert sentence.startswith("No speed-up is claimed") and "withdrawn" in sentence
    asr = [rec for _, rec in withdrawn if rec["workload"] == "asr"]
    assert asr and all("(early)" in ", ".join(docs.withdrawal_reasons(r)) for r in asr)


def test_a_fair_record_renders_its_claims() -> None:
    times = {"ddp": [300.0, 310.0, 305.0], "ddp_bf16": [250.0, 260.0, 240.0],
             "adpsgd_hier_bf16": [150.0, 160.0, 170.0]}
    fair = [("asr_2x2_200mbit_0.5ms.json", fair_record(times))]
    table = docs.race_part(fair, [])
    assert "| adpsgd_hier_bf16 | 0.003 | 3 | 160 | 150-170 | 0.53 | 0.64 | faster | faster |" \
        in table
    assert "| ddp | 0.003 | 3 | 305 | 300-310 | 1.00 | 1.22 | - | slower |" in table
    sentence = " ".join(docs.results_sentence(fair).split())
    assert "(best peer `ddp_bf16`): `adpsgd_hier_bf16` 0.53x (0.64x the best peer's, faster in " \
        "every run)" in sentence, sentence
    loaded = [("x.json", fair_record(times, latency_ms=0.0))]
    assert "No claim from this race: no link latency emulated." in " ".join(
        docs.race_part(loaded, []).split())
    assert docs.results_sentence(loaded).startswith("No speed-up is claimed")


def test_the_remedies_race_is_labelled_and_left_out_of_the_readme_sentence() -> None:
    """The remedies' race has fewer peers than the main race: its tables say which race it is,
    and the README's sentence (the library against every peer) does not quote it."""
    times = {"ddp": [300.0, 310.0, 305.0], "postlocal16": [250.0, 260.0, 240.0],
             "dpsgd_hier_bf16": [150.0, 160.0, 170.0],
             "dpsgd_hier_bf16_overlap": [140.0, 150.0, 145.0]}
    remedies = [("asr_2x2_200mbit_0.5ms_remedies.json", fair_record(times))]
    assert "0.5 ms, the remedies' race" in " ".join(docs.race_part(remedies, []).split())
    assert docs.results_sentence(remedies).startswith("No speed-up is claimed")
