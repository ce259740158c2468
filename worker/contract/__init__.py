"""The job contract both sides share: settings, job records and their states, storage keys,
queues and dispatch, job options and their values, results and their formats, upload
inspection.

Light on purpose: these modules import neither torch nor FastAPI, so the API image stays
small; the worker and the API import them, never the other way round.
"""
