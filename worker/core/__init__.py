"""The engine core: a process of its own that holds the models and batches every job's inputs
(`process`: the process and the worker's side of its pipe), a batcher per model (`batching`),
the models open and their memory (`engines`), what a call can end in (`calls`) and how a
job's options and result map to the engine's (`transcripts`).

Imports `worker.contract`, the shared modules and `engine`. Torch is imported only in the
core process: `calls`, `transcripts` and `process`'s client side are light, for job
processes that never import it.
"""
