"""Tools that measure the engine, apart from what runs in a worker: `bench` (speed against
plain transformers), `gpu_checks` (real weights on real speech, GPU paths against the CPU
reference), `evaluate` (WER, language ID and speed on a manifest). Each drives the same public
`Stream` the workers drive, so it measures what runs."""
