"""Records make the docs: the decision table by R of docs/choosing.md, the race tables of
docs/races.md, the demo's parity table of docs/benchmarks.md and the README's results sentence
are what ``benchmarks/race/docs.py`` generates from ``benchmarks/results/`` (regenerate with
``python -m benchmarks.race.docs``).

Also: the generated text claims no speed-up while no fair record exists, lists every withdrawn
record, renders a fair record's claims only where ``rules.score`` allows them, fills a
regime's row only from a record (labelling the schema-2 stand-ins) and compares ``"auto"``
with the best fixed period.
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
    # what the claim rests on is said with it: the target, the seeds, R
    assert "Races to 20 % the metric, one seed for every run, R not measured" in sentence, sentence
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


def test_the_decision_table_says_where_no_record_supports_a_cell() -> None:
    """Without records of the races by regime, each regime row takes the schema-2 records of
    its link, labelled (R not measured, target 20 %), or says "not raced yet"; no cell is
    filled without a record, and choosing.md holds no copy of the races' tables."""
    from tests.test_race_rules import fair_record

    fair = [("asr_2x2_200mbit_0.5ms.json", fair_record({
        "ddp": [300.0, 310.0, 305.0], "postlocal16": [250.0, 260.0, 240.0],
        "dpsgd_hier_bf16": [150.0, 160.0, 170.0]}, schema=2))]
    table = docs.decision_table([], fair)
    rows = [line for line in table.splitlines() if line.startswith("| ")][1:]
    assert len(rows) == len(docs.REGIMES)  # one row each: a record, or none yet
    low = next(r for r in rows if "fair/asr_2x2_200mbit_0.5ms.json" in r)
    assert "R not measured (schema 2)" in low and "target 20 % dev WER" in low
    assert "`dpsgd_hier_bf16` (0.53x ddp's median time, 0.64x the best peer's" in low
    assert "faster than every other case in every run" in low
    for regime in ("1.5 <= R <= 4", "R >= 6"):
        row = next(r for r in rows if r.startswith(f"| {regime} "))
        assert row.count("not raced yet") == 2 and "none yet" in row
    assert "`dpsgd_hier_bf16`: `DPSGDStrategy(hierarchical=True, wire_dtype=\"bf16\")`" in \
        " ".join(table.split())
    choosing = (ROOT / "docs" / "choosing.md").read_text()
    assert docs.MARKERS["race-table"][0] not in choosing
    assert docs.MARKERS["decision-table"][0] in choosing
    owners = [part for parts in docs.TARGETS.values() for part in parts]
    assert len(owners) == len(set(owners))  # every generated part lives in one file


def test_a_regime_record_takes_its_row_and_compares_auto_with_the_best_fixed_period() -> None:
    """A schema-3 record at R 2.2 fills the 1.5 <= R <= 4 row (the peer with the lowest median
    is named, the cases whose runs overlap it too) and its "auto" cell: the "auto" case's median
    over its family's fastest fixed period's, against the goal of 1.10x."""
    from tests.test_race_rules import schema3_record

    times = {"ddp_bf16": [300.0, 310.0, 305.0], "postlocal64": [150.0, 155.0, 160.0],
             "dpsgd_hier_bf16_p4": [200.0, 210.0, 220.0],
             "dpsgd_hier_bf16_p16": [180.0, 190.0, 185.0],
             "dpsgd_hier_bf16_pauto": [195.0, 200.0, 190.0],
             "adpsgd_hier_bf16": [158.0, 170.0, 165.0]}
    rec = schema3_record(times, comm_compute_ratio=2.2, rate_mbit=50.0,
                         ddp_reference={"samples_to_target": 4800})
    for k, run in enumerate(rec["cases"]["dpsgd_hier_bf16_pauto"]["runs"]):
        run["auto_period"] = [{"period": 3 + k, "decisions": [{"ratio": 2.0 + k / 10}]}] * 4
    (auto,) = docs.auto_comparisons(rec)
    assert (auto["fixed"], auto["ratio"], auto["met"]) == ("dpsgd_hier_bf16_p16", 1.054, True)
    assert auto["periods"] == [3, 4, 5] and auto["ratios"] == [2.0, 2.1, 2.2]
    fair = [("asr_2x2_200mbit_0.5ms.json", rec | {"comm_compute_ratio": None, "schema": 2,
                                                  "rate_mbit": 200.0})]
    table = docs.decision_table([("asr_2x2_30mbit_0.5ms.json", rec)], fair)
    mid = next(r for r in table.splitlines() if "regimes/asr_2x2_30mbit_0.5ms.json" in r)
    assert mid.startswith("| 2.20 | none | 0.5 ms one way | `postlocal64`")
    assert "the runs of `adpsgd_hier_bf16` overlap its range" in mid
    assert "`dpsgd_hier_bf16_pauto` 1.05x `dpsgd_hier_bf16_p16` (met)" in mid
    assert "R 2.20 (measured)" in mid and "target 12 % dev WER" in mid
    assert "fair/asr_2x2_200mbit_0.5ms.json" in table  # R < 1 has no regime record yet
    text = " ".join(docs.race_part(fair, [], [("asr_2x2_30mbit_0.5ms.json", rec)]).split())
    assert "1.05x the median time of its family's fastest fixed period, " \
        "`dpsgd_hier_bf16_p16` (goal at most 1.10x: met)" in text
    assert "The earlier campaign's records (schema 2" in text
