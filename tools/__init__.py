"""Tools that measure the engine, apart from the runtime packages: `bench` (speed against
plain transformers), `gpu_checks` (real weights on real speech, GPU paths against the CPU
reference), `evaluate` (WER, language ID and speed on a manifest), and the references the
accuracy checks compare with (`longform`, `word_timing`, `qwen3_asr`, `wer`). Each drives the
same public `Stream` the workers drive, so it measures what runs. The scripts under
`scripts/` and `whisperfleet eval` and `bench` (`worker.cli`) use them; nothing that serves
jobs imports them.
"""
