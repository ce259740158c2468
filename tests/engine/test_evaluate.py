"""`whisperfleet eval` on the test clips: it runs, and engine and transformers agree."""

from pathlib import Path

import pytest

from tools.evaluate import ClipResult, ManifestError, Report, evaluate, read_manifest

DATA = Path(__file__).parent.parent / "data"


def test_eval_reports_engine_and_transformers_side_by_side(tiny_en, capfd):
    report = evaluate(DATA / "manifest.jsonl", tiny_en, seeds=2)
    # the table alone: no bar for transformers' loading, no warning about its internals
    printed = capfd.readouterr()
    assert "Loading weights" not in printed.err and "deprecated" not in printed.err
    assert [c.language for c in report.clips] == ["en"] * 3  # English-only model: no French
    rows = {metric: (engine, reference) for metric, engine, reference in report.rows()}
    engine, reference = rows["WER %, English clips <= 30 s (3)"]
    assert float(engine) <= float(reference) + 0.3
    assert rows["greedy tokens identical, clips <= 30 s"][0] == "3/3"
    assert rows["segment timestamps monotonic and inside the audio"][0] == "3/3"
    assert float(rows["audio seconds per second"][0]) > 0
    assert report.table().startswith(  # the French clip left out, and said so
        "model tiny.en, cpu float32, 3 of the manifest's 4 clips: 1 not English left out"
    )
    # the default pipeline at seeds 0 and 1: these clips never fall back, so never sample
    assert [len(c.seed_texts) for c in report.clips] == [2, 2, 2]
    spread = rows["WER %, English clips <= 30 s, seeds 0-1: mean ± sd (min-max)"][0]
    assert spread == f"{engine} ± 0.00 ({engine}-{engine})"
    assert rows["English clips whose text changes with the seed"][0] == "0/3"


def test_without_transformers_its_column_stays_empty_and_languages_are_counted_apart():
    """`eval --no-reference` leaves transformers' column out (its WER was shown as 100.00);
    a multilingual model's non-English clips are scored by language identification."""
    clips = [
        ClipResult("a.flac", 2.0, "en", "ask not", "ask not", engine_seconds=1.0),
        ClipResult("b.flac", 2.0, "fr", "bonjour", "bonjour", engine_seconds=1.0),
    ]
    clips[1].engine_language = "fr"
    report = Report("base", "cpu float32", clips, reference=False)
    assert report.table().splitlines()[0] == (
        "model base, cpu float32, 2 clips: "
        "WER on 1 English, language identification on 1 not English"
    )
    rows = {metric: (engine, reference) for metric, engine, reference in report.rows()}
    assert rows["WER %, English clips <= 30 s (1)"] == ("0.00", "")
    assert rows["language detected correctly (1 non-English)"] == ("1/1", "")


@pytest.mark.parametrize(
    "line, message",
    [
        (
            '{"file": "gone.flac", "reference": "", "language": "en", "duration_s": 1}',
            "line 2: no such file",
        ),
        ('{"file": "en_jfk.flac"}', "line 2: expected JSON with file, reference, language"),
        ("not json", "line 2: expected JSON"),
    ],
)
def test_a_manifest_is_checked_line_by_line_before_any_work(tmp_path, line, message):
    manifest = tmp_path / "manifest.jsonl"
    first = (DATA / "manifest.jsonl").read_text().splitlines()[0]
    (tmp_path / "en_jfk.flac").write_bytes((DATA / "en_jfk.flac").read_bytes())
    manifest.write_text(f"{first}\n{line}\n")
    with pytest.raises(ManifestError, match=message):
        read_manifest(manifest)
    with pytest.raises(ManifestError, match="No such file"):
        read_manifest(tmp_path / "none.jsonl")
