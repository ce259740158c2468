"""Which queues a worker takes jobs from now: what the API's `/readyz` answers from.

A worker is present on a queue once Celery consumes it and its default model is loaded, and
stays so while its heartbeat renews the mark (every lease_s / 3, only while its engine turns);
it withdraws as it begins to shut down. A worker that dies without withdrawing lapses after
its time to live. Kept in Redis as a sorted set per queue, `whisperfleet:workers:<queue>`,
of worker ids scored by when their mark lapses, in Redis's own clock (the API and the workers
run on hosts whose clocks may differ).
"""

from __future__ import annotations

import redis

# KEYS: the queues' sets; ARGV: worker id, time to live (ms). Marks the worker on each, and
# forgets the lapsed marks there.
_MARK = """
local t = redis.call('time')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
for _, key in ipairs(KEYS) do
  redis.call('zremrangebyscore', key, '-inf', now)
  redis.call('zadd', key, now + tonumber(ARGV[2]), ARGV[1])
end
return now
"""

# KEYS: the queues' sets. How many marks on each have not lapsed.
_COUNT = """
local t = redis.call('time')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local counts = {}
for i, key in ipairs(KEYS) do
  counts[i] = redis.call('zcount', key, '(' .. now, '+inf')
end
return counts
"""


class Presence:
    def __init__(self, client: redis.Redis, prefix: str = "whisperfleet"):
        self.redis, self.prefix = client, prefix
        self._mark = client.register_script(_MARK)
        self._count = client.register_script(_COUNT)

    def _key(self, queue: str) -> str:
        return f"{self.prefix}:workers:{queue}"

    def mark(self, worker_id: str, queues: list[str], ttl_s: float) -> None:
        self._mark(keys=[self._key(q) for q in queues], args=[worker_id, int(ttl_s * 1000)])

    def withdraw(self, worker_id: str, queues: list[str]) -> None:
        with self.redis.pipeline(transaction=False) as pipe:
            for q in queues:
                pipe.zrem(self._key(q), worker_id)
            pipe.execute()

    def workers(self, queues: list[str]) -> dict[str, int]:
        """How many workers take jobs from each queue now."""
        counts = self._count(keys=[self._key(q) for q in queues])
        return dict(zip(queues, map(int, counts), strict=True))
