"""The prefix cache: keys/values of recently finished sequences that a request starting the same way prefills
after (a conversation's next turn, a shared system prompt); of a model with recurrent layers, their states too, at
exactly the tokens they stand for (a state cannot be cut back)."""

import collections

from . import logger
from .kvcache import each_state, growing


class PrefixCache:
    """Keys/values of recently finished sequences, keyed by their tokens, bounded in bytes (LRU)."""

    def __init__(self, max_bytes):
        self.max_bytes, self.bytes = max_bytes, 0
        # tuple(tokens) -> (layers, bytes, buffers or None, the fewest tokens of it a request must start with,
        # recurrent layers' states or None)
        self.entries = collections.OrderedDict()

    def put(self, tokens, layers, size=None, buffers=None, windows=None, states=None):
        """Keeps `layers` for `tokens`; `buffers`: per layer the buffers they start, which a next turn may take
        over; `size`: the bytes held alive, when more than the layers'. A layer of fewer positions than the tokens
        holds the last ones only. Where `windows` gives its window (rungen/kvcache.py's SlidingLayer, whose positions
        lie in order), the entry serves a start whose window it still holds; else (a sliding layer's ring,
        rungen/slots.py) only a request that starts with all of it (a conversation's next turn). `states`: a
        recurrent model's row (kvcache.states_of's) after exactly `tokens`: the entry serves only a request that
        starts with all of them."""
        size = size or sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)
        size += sum(part.numel() * part.element_size() for state in states or () for part in state
                    if part is not None)
        key = tuple(tokens)
        if size > self.max_bytes or len(key) < 2 or key in self.entries:
            return
        windows = windows if windows and len(windows) == len(layers) else [0] * len(layers)
        least = 0
        for (keys, _), window in zip(layers, windows):
            gone = len(key) - keys.shape[-2]
            if gone > 0:
                least = max(least, gone + window - 1 if window else len(key))
        self.entries[key] = (layers, size, buffers, len(key) if states else least, states)
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

    def longest(self, ids, states=True):
        """(length, layers, buffers, states) for the longest start of ids an entry holds, one token left to prefill,
        or (0, None, None, None). `layers` and `states` are views, never to be written to; when the start is the
        whole entry and it kept its buffers, they come too and the entry leaves the cache. `states`: whether the
        caller takes a recurrent model's states (else their entries are passed over)."""
        best, found = 0, None
        for key, (*_, least, held) in self.entries.items():
            length = shared_start(key, ids, limit=len(ids) - 1)
            if length > best and length >= least and (states or held is None):
                best, found = length, key
        if found is None:
            return 0, None, None, None
        layers, size, buffers, _, held = self.entries[found]
        if buffers is not None and best == len(found):
            del self.entries[found]
            self.bytes -= size
            return best, layers, buffers, held
        self.entries.move_to_end(found)
        # (a layer holding the last positions only: those up to the start's end; a ring: whole)
        return best, [(k[:, :, : best - len(found) + k.shape[-2]], v[:, :, : best - len(found) + v.shape[-2]])
                      for k, v in layers], None, held

    def keep(self, tokens, layers, batch_cache=None, windows=None, states=None):
        """Keeps a finished row's keys/values `layers` for `tokens`: copies, unless `batch_cache` (the batch ends
        with this row) hands its buffers over; `windows`: put's; `states`: put's, copied."""
        states = None if states is None else each_state(states, lambda part: part.clone())
        if batch_cache is None:
            self.put(tokens, [(k.clone(), v.clone()) for k, v in layers], windows=windows, states=states)
            return
        length = len(tokens)
        held = sum(k.untyped_storage().nbytes() + v.untyped_storage().nbytes() for k, v in layers)
        # Growing layers that hold just this row from their buffers' start: a next turn can grow in them.
        grown = [layer.buffers for layer in batch_cache.layers if growing(layer)
                 and layer.buffers is not None and layer.keys.shape[0] == 1 and layer.get_seq_length() == length
                 and layer.keys.data_ptr() == layer.buffers[0].data_ptr()]
        buffers = grown if len(grown) == len(layers) else None
        self.put(tokens, layers, size=held, buffers=buffers, windows=windows, states=states)


def shared_start(a, b, limit):
    """How many first items a and b have in common, at most `limit`."""
    length = 0
    for x, y in zip(a[:limit], b):
        if x != y:
            break
        length += 1
    return length
