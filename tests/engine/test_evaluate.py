"""`whisperfleet eval` on the test clips: it runs, and engine and transformers agree."""

from pathlib import Path

from engine.tools.evaluate import evaluate

DATA = Path(__file__).parent.parent / "data"


def test_eval_reports_engine_and_transformers_side_by_side(tiny_en):
    report = evaluate(DATA / "manifest.jsonl", tiny_en, seeds=2)
    assert [c.language for c in report.clips] == ["en"] * 3  # English-only model: no French
    rows = {metric: (engine, reference) for metric, engine, reference in report.rows()}
    engine, reference = rows["WER %, English clips <= 30 s (3)"]
    assert float(engine) <= float(reference) + 0.3
    assert rows["greedy tokens identical, clips <= 30 s"][0] == "3/3"
    assert rows["segment timestamps monotonic and inside the audio"][0] == "3/3"
    assert float(rows["audio seconds per second"][0]) > 0
    assert report.table().startswith("model tiny.en, cpu float32, 3 clips")
    # the default pipeline at seeds 0 and 1: these clips never fall back, so never sample
    assert [len(c.seed_texts) for c in report.clips] == [2, 2, 2]
    spread = rows["WER %, English clips <= 30 s, seeds 0-1: mean ± sd (min-max)"][0]
    assert spread == f"{engine} ± 0.00 ({engine}-{engine})"
    assert rows["English clips whose text changes with the seed"][0] == "0/3"
