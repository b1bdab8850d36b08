"""The prefix cache: keys/values of recently finished sequences that a request starting the same way prefills
after (a conversation's next turn, a shared system prompt)."""

import collections

from . import logger
from .kvcache import growing


class PrefixCache:
    """Keys/values of recently finished sequences, keyed by their tokens, bounded in bytes (LRU)."""

    def __init__(self, max_bytes):
        self.max_bytes, self.bytes = max_bytes, 0
        # tuple(tokens) -> (layers, bytes, buffers or None, whether only the whole entry serves)
        self.entries = collections.OrderedDict()

    def put(self, tokens, layers, size=None, buffers=None):
        """Keeps `layers` for `tokens`; `buffers`: per layer the buffers they start, which a next turn may take
        over; `size`: the bytes held alive, when more than the layers'. A layer of fewer positions than the tokens
        (a sliding layer's ring, rungen/slots.py, or rungen/kvcache.py's SlidingLayer) holds the last ones only: the
        entry serves only a request that starts with all of it (a conversation's next turn)."""
        size = size or sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)
        key = tuple(tokens)
        if size > self.max_bytes or len(key) < 2 or key in self.entries:
            return
        self.entries[key] = (layers, size, buffers, any(k.shape[-2] < len(key) for k, _ in layers))
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, dropped, *_) = self.entries.popitem(last=False)
            self.bytes -= dropped

    def give_up(self, why) -> bool:
        """Drops every entry, the memory short for `why` (out of GPU memory: the cache only saves time); False where
        it held none."""
        if not self.entries:
            return False
        logger.warning("out of GPU memory for %s: the prefix cache's %.1f MiB given up", why, self.bytes / 2**20)
        self.entries.clear()
        self.bytes = 0
        return True

    def longest(self, ids):
        """(length, layers, buffers) for the longest start of ids an entry holds, one token left to prefill, or
        (0, None, None). `layers` are views, never to be written to; when the start is the whole entry and it kept
        its buffers, they come too and the entry leaves the cache."""
        best, found = 0, None
        for key, (*_, whole_only) in self.entries.items():
            length = shared_start(key, ids, limit=len(ids) - 1)
            if length > best and (length == len(key) or not whole_only):
                best, found = length, key
        if found is None:
            return 0, None, None
        layers, size, buffers, _ = self.entries[found]
        if buffers is not None and best == len(found):
            del self.entries[found]
            self.bytes -= size
            return best, layers, buffers
        self.entries.move_to_end(found)
        return best, [(k[:, :, :best], v[:, :, :best]) for k, v in layers], None  # (a ring: whole)

    def keep(self, tokens, layers, batch_cache=None):
        """Keeps a finished row's keys/values `layers` for `tokens`: copies, unless `batch_cache` (the batch ends
        with this row) hands its buffers over."""
        if batch_cache is None:
            self.put(tokens, [(k.clone(), v.clone()) for k, v in layers])
            return
        length = len(tokens)
        held = sum(k.untyped_storage().nbytes() + v.untyped_storage().nbytes() for k, v in layers)
        # Growing layers that hold just this row from their buffers' start: a next turn can grow in them.
        grown = [layer.buffers for layer in batch_cache.layers if growing(layer)
                 and layer.buffers is not None and layer.keys.shape[0] == 1 and layer.get_seq_length() == length
                 and layer.keys.data_ptr() == layer.buffers[0].data_ptr()]
        buffers = grown if len(grown) == len(layers) else None
        self.put(tokens, layers, size=held, buffers=buffers)


def shared_start(a, b, limit):
    """How many first items a and b have in common, at most `limit`."""
    length = 0
    for x, y in zip(a[:limit], b):
        if x != y:
            break
        length += 1
    return length
