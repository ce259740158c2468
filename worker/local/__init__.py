"""The local stack's own services, for a laptop and the tests: Redis and the S3 server
started when nothing answers (`embedded`), the S3 server (`s3_server`: moto behind a door
that checks SigV4, `s3_gate`, keeping objects on disk, `s3_disk`).

Imports `worker.contract` and the shared modules.
"""
