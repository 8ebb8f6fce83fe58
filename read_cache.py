"""Answers of reads that repeat, kept in memory (the read cache): what agents poll and boards refresh is answered
again from here until a write could have changed it.

An answer is stored under (the database's generation, what was asked, who asked). The generation is a number every
write that could change an answer advances in its own transaction (the `generation` table and its triggers); a read
takes it before it computes its answer, so an answer is never older than the generation it is kept under, and a
read that starts after a write's commit never finds an answer from before it. Memory is bounded by the bytes of
the answers kept: the least recently used go first. Below the rules: it imports nothing of ours.
"""

import threading
from collections import OrderedDict

ENTRY_OVERHEAD = 200        # bytes counted for an entry beside its body and key: the tuple, the dict's slot


class ReadCache:
    """A byte-bounded LRU of answers: key -> (content type, body). `hits` and `misses` are counted for /metrics."""

    def __init__(self, max_bytes):
        self.max_bytes = max_bytes
        self.size = 0
        self.generation = 0         # the newest generation seen: older answers are forgotten when it advances
        self.hits = self.misses = 0
        self._entries = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def cost(key, content_type, body):
        return len(body) + sum(len(str(part)) for part in key) + len(content_type) + ENTRY_OVERHEAD

    def get(self, key):
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[:2]

    def put(self, key, content_type, body):
        cost = self.cost(key, content_type, body)
        if cost > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.size -= old[2]
            self._entries[key] = (content_type, body, cost)
            self.size += cost
            while self.size > self.max_bytes:
                _, (_, _, freed) = self._entries.popitem(last=False)
                self.size -= freed

    def forget_before(self, generation):
        """Drop the answers of older generations (nothing will ask for them again)."""
        with self._lock:
            for key in [key for key in self._entries if key[0] < generation]:
                self.size -= self._entries.pop(key)[2]

    def __len__(self):
        return len(self._entries)
