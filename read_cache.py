"""Answers of reads that repeat, kept in memory (the read cache): what agents poll and boards refresh is answered
again from here until a write could have changed it.

An answer is stored under (the database's generation, what was asked, who asked). The generation is a number every
write that could change an answer advances in its own transaction (the `generation` table and its triggers); a read
takes it before it computes its answer, so an answer is never older than the generation it is kept under, and a
read that starts after a write's commit never finds an answer from before it. Memory is bounded by the bytes of
the answers kept: the least recently used go first. An answer that changes with the clock though nothing is
written (the feed drops a job at its deadline) is kept with the moment it stops holding, and is not given after it.
Below the rules: it imports nothing of ours.
"""

import threading
from collections import OrderedDict

ENTRY_OVERHEAD = 200        # bytes counted for an entry beside its body and key: the tuple, the dict's slot


class ReadCache:
    """A byte-bounded LRU of answers: key -> (content type, body, ETag), each until a moment or for good. `hits` and
    `misses` are counted for /metrics."""

    def __init__(self, max_bytes):
        self.max_bytes = max_bytes
        self.size = 0
        self.generation = 0         # the newest generation seen: older answers are forgotten when it advances
        self.hits = self.misses = 0
        self._entries = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def cost(key, content_type, body, etag):
        return len(body) + sum(len(str(part)) for part in key) + len(content_type) + len(etag) + ENTRY_OVERHEAD

    def get(self, key, now=None):
        """(content type, body, ETag) kept under `key`, or None: never kept, forgotten, or no longer holding at
        `now` (compared with the moment given to put)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[3] is not None and now is not None and now >= entry[3]:
                self.size -= self._entries.pop(key)[4]
                entry = None
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[:3]

    def put(self, key, content_type, body, etag, until=None):
        """Keep an answer, for good or `until` a moment (of the kind get's `now` is)."""
        cost = self.cost(key, content_type, body, etag)
        if cost > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.size -= old[4]
            self._entries[key] = (content_type, body, etag, until, cost)
            self.size += cost
            while self.size > self.max_bytes:
                _, entry = self._entries.popitem(last=False)
                self.size -= entry[4]

    def forget_before(self, generation):
        """Drop the answers of older generations (nothing will ask for them again)."""
        with self._lock:
            for key in [key for key in self._entries if key[0] < generation]:
                self.size -= self._entries.pop(key)[4]

    def __len__(self):
        return len(self._entries)
