"""Where the engine's batch keeps its keys/values, behind one interface (part, merge, forward, keep, row_layers,
clear):

- SlotBatch: fixed slots (rungen/slots.py) on transformers' llama-shaped models, written in place; a row that ends
  frees its slot to the last row; on a CUDA GPU the steps replay CUDA graphs.
- PaddedBatch: everywhere else, a left-padded batch in the model's own cache; the mask and per-row positions hide
  the padding, so each row computes what it would alone.
"""

import os

import torch

from . import fused_step
from .kvcache import (
    RINGS_ENV,
    dummy,
    each_state,
    fill,
    full_attention,
    growing,
    holding,
    layers_of,
    new_cache,
    put_states,
    recurrent,
    sliding_windows,
    states_of,
)
from .prefill import pass_tokens
from .slots import DecodeGraphs, SlotCache, decode_step, prefill_step, takes_slots
from .transfers import accelerators_of, to_device

GRAPHS_ENV = "RUN_GENERATION_CUDA_GRAPHS"
COMPILE_ENV = "RUN_GENERATION_COMPILE"  # 1: the captured step compiled by torch.compile first (an experiment)
PREFILL_ENV = "RUN_GENERATION_PREFILL_TOGETHER"  # 0: on fixed slots too, each request prefilled alone


def batch_cache(model, device, use_positions, max_batch, context, lookahead=0, shapes=None):
    """The form the model takes: slots where it can (its layers computed on one device, the slots' own), else a
    padded batch. `lookahead`: positions a row may be fed past its request's reserve (a step launched before its end
    was read); `shapes`: layer_shapes of the model where the caller probed it already."""
    one_device = len(set(accelerators_of(model))) <= 1  # offloaded: on the first
    if not (context and one_device and takes_slots(model)):
        return PaddedBatch(model, device, use_positions)
    step = fused_step.for_model(model, device) or decode_step  # (on a GPU: the fused layers where the family has them)
    # The sliding layers hold rings (transformers' layers: the fused ones read every position), a prompt longer than
    # a pass going into its slot a pass at a time (prefill.py)
    rings = step is decode_step and prefills_together(model) and os.environ.get(RINGS_ENV, "1") != "0"
    slots = SlotCache.for_model(model, max_batch, context, pass_tokens(device, rings) + lookahead if rings else None)
    graphs = None  # RUN_GENERATION_CUDA_GRAPHS=0: eager steps on a GPU too
    if device.type == "cuda" and os.environ.get(GRAPHS_ENV, "1") != "0":
        graphs = DecodeGraphs(model, slots, compiled=os.environ.get(COMPILE_ENV) == "1", step=step)
    return SlotBatch(model, device, slots, graphs, lookahead, step, shapes)


class LeftOut(torch.OutOfMemoryError):
    """A merge ran out of GPU memory and left the joining rows out, but for the first `kept` of them (into an empty
    batch, the first request's): the batch holds the rows it held before, and those."""

    def __init__(self, message, kept=0):
        super().__init__(message)
        self.kept = kept


class SlotBatch:
    """Rows 0..rows-1 in the slots of a SlotCache."""

    steps_again = True  # a step that failed may run again: it writes by position, and moves nothing
    windows = None  # (a ring's positions lie round it: a prefix cache entry of one serves whole only)

    def __init__(self, model, device, slots, graphs=None, lookahead=0, step=decode_step, shapes=None):
        self.model, self.device, self.slots, self.graphs, self.lookahead = model, device, slots, graphs, lookahead
        self.step = step  # the eager step: transformers' layers (decode_step) or rungen.fused_step's
        self.prefills_together = prefills_together(model)
        self.pass_tokens = pass_tokens(device, self.rings)  # the most a prefill's pass takes
        self.shapes = shapes  # each layer's key and value shapes (layer_shapes), probed once

    @property
    def rings(self) -> bool:
        """Whether the sliding layers hold rings (a prompt longer than a pass then goes into its slot a pass at a
        time, on a CPU too)."""
        return self.slots.ring is not None

    @property
    def form(self):
        slots = "fixed slots, fused layers" if fused_step.fused(self.step) else "fixed slots"
        if self.rings:
            slots += f", the sliding layers in rings of {self.slots.ring} positions"
        if self.graphs is None:
            return slots
        compiled = "compiled and " if self.graphs.compiled else ""
        return f"{slots}, decode steps {compiled}replayed from CUDA graphs"

    def part(self, output, n, length):
        """What a prefilled request brings to merge(): its keys/values, copied into each of its n rows' slots."""
        return layers_of(output.past_key_values), n

    def prefill(self, prompts, reserve, chunk=None):
        """Prefills the prompts [(ids, reused, the prefix cache's layers, n)] in one pass into the slots after the
        batch's, each prompt's n rows in a row (its first slot prefilled, the others copies of it), every slot
        holding `reserve` positions; returns each prompt's next-token logits [prompts, vocabulary]. `chunk`: a
        prompt alone goes in passes of that many tokens at most (each reading the slot's positions before it)."""
        first = self.slots.rows
        counts = [n for *_, n in prompts]
        self.slots.ensure(first + sum(counts), reserve + self.lookahead, self.like())
        for number, (_, reused, layers, _) in enumerate(prompts):
            if reused:
                self.slots.write(first + number, layers)
        passes = [([ids[reused:] for ids, reused, *_ in prompts], [reused for _, reused, *_ in prompts])]
        if chunk and len(prompts) == 1:
            (ids, reused, *_), = prompts
            passes = [([ids[start:start + chunk]], [start]) for start in range(reused, len(ids), chunk)]
        with torch.inference_mode():  # (the slots stay normal tensors: rows leaving move them outside it)
            for tokens, starts in passes:
                logits = prefill_step(self.model, self.slots, first, tokens, starts, self.device)
        # Prompt b sits in slot first + b; its rows start at first + the rows before it: later prompts move first.
        for number in reversed(range(len(prompts))):
            base, length = first + sum(counts[:number]), len(prompts[number][0])
            if base != first + number:
                self.slots.move(first + number, base, length)
            for extra in range(1, counts[number]):
                self.slots.move(base, base + extra, length)
        self.slots.rows = first + sum(counts)
        return logits

    def like(self):
        """A layer list [(keys, values)] in the dtype, device and head shapes the slots take (SlotCache.ensure)."""
        if self.slots.keys:
            return list(zip(self.slots.keys, self.slots.values))
        if self.shapes is None:
            self.shapes = layer_shapes(probed_layers(self.model, self.device))
        dtype = self.model.dtype  # the activations' (a GGUF file's blocks hold no float weight to ask)
        return [tuple(torch.empty(1, heads, 0, size, dtype=dtype, device=self.device) for heads, size in shapes)
                for shapes in self.shapes]

    def make_room(self, rows, reserve):
        """Slots for `rows` rows of `reserve` positions (before a prefill, so that running out of memory for them
        happens before any row joins)."""
        self.slots.ensure(rows, reserve + self.lookahead, self.like())

    def merge(self, parts, rows):
        """Writes the joined rows' keys/values into the slots after the batch's: `rows` the whole batch (parts of
        None: prefilled in their slots already)."""
        parts = [part for part in parts if part is not None]
        if not parts:
            return
        slot = self.slots.rows
        try:  # (make_room gave prefilled groups their slots already: only rows prefilled alone may need more)
            self.slots.ensure(len(rows), max(row.request.reserve for row in rows) + self.lookahead, parts[0][0])
        except torch.OutOfMemoryError as error:  # the slots as they were
            raise LeftOut(str(error)) from error
        for layers, n in parts:
            for _ in range(n):
                self.slots.write(slot, layers)
                slot += 1
        self.slots.rows = slot

    def forward(self, rows, tokens):
        positions = to_device([row.position for row in rows], self.device)
        longest = max(row.position for row in rows)
        with torch.inference_mode():
            if self.graphs is not None:
                return self.graphs(tokens, positions, longest)
            return self.step(self.model, self.slots, tokens, positions, self.slots.step_length(longest))

    def keep(self, rows, keep, done):
        """Keeps rows `keep`, the last rows moving into freed slots (rows stay in 0..rows-1); returns the new order."""
        order = list(range(len(keep)))
        movers = [number for number in keep if number >= len(keep)]
        for hole, mover in zip([number for number in done if number < len(keep)], movers):
            self.slots.move(mover, hole, rows[mover].position)
            order[hole] = mover
        self.slots.rows = len(keep)
        if not keep and self.graphs is None:  # graphs replay over the buffers: kept for the next batch
            self.slots.clear()
        return order

    def row_layers(self, number, length, fed, last):
        """A row's keys/values of its first `length` positions (of the `fed` it holds), the buffers the prefix
        cache may take and its recurrent states (none)."""
        return self.slots.row_layers(number, length), None, None

    def held(self):
        """Whether any row's keys/values are held."""
        return self.slots.rows > 0

    def clear(self):
        self.slots.clear()


class PaddedBatch:
    """Rows in one left-padded cache of the model's own kind, with their attention mask; a recurrent layer's states
    (kvcache.recurrent: no positions to pad) a row each, in the rows' order."""

    form = "a left-padded batch"
    prefills_together = rings = False

    def __init__(self, model, device, use_positions):
        self.model, self.device, self.use_positions = model, device, use_positions
        self.cache = self.mask = None
        # each layer's window where the own model's sliding layers hold their last positions (None: none do)
        windows = sliding_windows(model)
        self.windows = windows if any(windows) else None

    @property
    def steps_again(self):
        """Whether a step that failed may run again: forward puts the layers' keys/values back as they were, unless
        they grow in place (the own model's, on the CPU only, whose allocator raises no out-of-memory error)."""
        if self.cache is None:
            return True
        # (a recurrent layer's state went on in place: the step would take it on twice)
        return not growing(holding(self.cache)[0]) and not states_of(self.cache)

    def part(self, output, n, length):
        """What a prefilled request brings to merge(): its keys/values (for n rows), their mask, its cache, and its
        recurrent layers' states (for n rows)."""
        layers, states = layers_of(output.past_key_values), states_of(output.past_key_values)
        if n > 1:
            layers = [(k.repeat(n, 1, 1, 1), v.repeat(n, 1, 1, 1)) for k, v in layers]
            states = each_state(states, lambda part: part.repeat(n, *[1] * (part.dim() - 1)))
        mask = torch.ones(n, length, dtype=torch.long, device=self.device)
        return layers, mask, output.past_key_values if n == 1 else None, states

    def make_room(self, rows, reserve):
        """Nothing: the padded batch grows as rows merge."""

    def merge(self, parts, rows):
        """Appends the parts' rows, left-padded to the longest, a layer at a time: a layer's old keys/values go
        before the next layer is copied, so beyond the batch's keys/values the merge holds two copies of one layer
        (the concatenation, and the cache's own), not a copy of every layer (a lone part into an empty batch: no
        copy). Out of GPU memory: LeftOut, the batch's rows as they were (put_back), or into an empty batch the
        first request's rows in its own cache."""
        if self.cache is None and len(parts) == 1:
            layers, mask, cache, states = parts[0]
            self.cache = cache if cache is not None else own_cache(self.model, layers, mask.shape[1], states)
            self.mask = mask
            return
        old, groups = self.cache, [(list(layers), mask) for layers, mask, *_ in parts]
        if old is not None:
            groups.insert(0, (layers_of(old), self.mask))
        width = max(mask.shape[1] for _, mask in groups)
        self.cache = cache = new_cache(self.model)
        rows_states = ([states_of(old)] if old is not None else []) + [states for *_, states in parts]
        if rows_states[0]:  # (a row's state is its own: the rows' states one after another, nothing padded)
            put_states(cache, [[None if pieces[0] is None else torch.cat(pieces) for pieces in zip(*layer)]
                               for layer in zip(*rows_states)])
        held = holding(old) if old is not None else None
        for number, layer in enumerate(holding(cache)):
            merged = None
            try:
                # A sliding layer that let go of its first positions in some group holds their last ones only: as
                # many as the fewest such a group holds (all within the window), the others' left-padded to them
                kept = min([width] + [layers[number][0].shape[2] for layers, mask in groups
                                      if layers[number][0].shape[2] < mask.shape[1]])
                merged = [torch.cat([left_pad(layers[number][kind][:, :, -kept:], kept) for layers, _ in groups])
                          for kind in (0, 1)]
                if old is not None:
                    let_go(held[number])
                fill(layer, *merged, width)
            except torch.OutOfMemoryError as error:
                first_layers, first_mask, first, first_states = parts[0]
                if old is None and first is None and not growing(holding(cache)[0]):
                    self.cache = cache = merged = None  # the merge's copies go before the first's rows are copied
                    first = own_cache(self.model, first_layers, first_mask.shape[1], first_states)
                if old is None and first is not None and not growing(holding(first)[0]):
                    self.cache, self.mask = first, first_mask  # the first request alone, in its own cache
                    raise LeftOut(str(error), kept=first_mask.shape[0]) from error
                if old is None or growing(holding(old)[0]):  # nothing to go on with: the caller ends every row
                    raise
                self.put_back(old, groups[0][1], layers_of(cache)[:number] + ([merged] if merged else []))
                raise LeftOut(str(error)) from error
            for layers, _ in groups:
                layers[number] = None
            del merged  # (the cache copied it)
        self.mask = torch.cat([left_pad(mask, width, dim=1) for _, mask in groups])

    def put_back(self, old, mask, copies):
        """The batch's cache `old` and `mask` again after a merge stopped: its first layers, whose keys/values were
        let go, read from the merge's `copies` of them, their first rows and last columns (the views hold the whole
        copies until the next step grows them)."""
        rows, width = mask.shape
        for held, (keys, values) in zip(holding(old), copies):
            held.keys, held.values = (kept[:rows, :, kept.shape[2] - width:] for kept in (keys, values))
        self.cache, self.mask = old, mask

    def forward(self, rows, tokens):
        mask = torch.cat([self.mask, torch.ones(len(rows), 1, dtype=torch.long, device=self.device)], 1)
        kwargs = {}
        if self.use_positions:
            kwargs["position_ids"] = to_device([[row.position] for row in rows], self.device)
        layers = layers_of(self.cache)
        try:
            with torch.inference_mode():
                output = self.model(input_ids=tokens, attention_mask=mask, past_key_values=self.cache,
                                    use_cache=True, **kwargs)
        except torch.OutOfMemoryError:  # the layers that grew before it ran out shrink back: the step may run again
            if self.steps_again:
                for layer, (keys, values) in zip(holding(self.cache), layers):
                    layer.keys, layer.values = keys, values
            raise
        self.cache, self.mask = output.past_key_values, mask
        return output.logits[:, -1].float()

    def keep(self, rows, keep, done):
        """Keeps the rows numbered `keep` and trims the columns that are padding in every one of them, a layer at a
        time."""
        if not keep:
            self.clear()
            return keep
        index = to_device(keep, self.device)
        mask = self.mask.index_select(0, index)
        first = int(mask.any(0).long().argmax())  # columns before it are padding in every row left
        self.mask = mask[:, first:]
        old, self.cache = self.cache, new_cache(self.model)
        states = states_of(old)
        if states:
            put_states(self.cache, each_state(states, lambda part: part.index_select(0, index)))
        for layer, held in zip(holding(self.cache), holding(old)):  # a layer at a time, as merge()
            keys, values, length = held.keys, held.values, held.get_seq_length()
            let_go(held)
            rows = index.to(keys.device)  # (itself on one device; --device_map spreads the layers over GPUs)
            start = max(0, first - (length - keys.shape[2]))  # (a sliding layer's positions held start later)
            fill(layer, keys.index_select(0, rows)[:, :, start:], values.index_select(0, rows)[:, :, start:],
                 length - first)
            del keys, values
        return keep

    def row_layers(self, number, length, fed, last):
        """A row's keys/values of its first `length` positions of the `fed` it holds, the batch's last ones (None
        where padding lies among them), the buffers the prefix cache may take over (`last`), and its recurrent
        layers' states (views), which stand for all `fed` (None where `length` is fewer: a state is not cut back)."""
        end = length - fed or None  # the row's positions end where the batch's do
        states = states_of(self.cache)
        if not self.mask[number, -fed:end].all() or (states and length != fed):
            return None, None, None
        layers = [(k[number : number + 1, :, -fed:end], v[number : number + 1, :, -fed:end])
                  for k, v in layers_of(self.cache)]
        states = each_state(states, lambda part: part[number : number + 1]) if states else None
        return layers, self.cache if last else None, states

    def held(self):
        return self.cache is not None

    def clear(self):
        self.cache = self.mask = None


def probed_layers(model, device, model_type="the model", token=0, states=None):
    """[(keys, values)] of each layer that holds them (layers_of) after a one-token forward pass of `token` into a
    fresh cache (`states`, a list, given its recurrent layers' states: states_of's); raises ValueError for a model
    whose layers a batch cannot hold."""
    cache = new_cache(model)  # (one position: every layer holds it, a sliding one too)
    if not all(full_attention(layer) or dummy(layer) or recurrent(layer) for layer in cache.layers) \
            or not holding(cache):
        # A chunked layer's (or another kind's) state cannot be moved by the left-padded merge and trim.
        raise ValueError(f"{model_type} has chunked-attention layers or others this tool's padded batch cannot "
                         "hold")
    with torch.inference_mode():
        model(input_ids=torch.tensor([[token]], device=device), past_key_values=cache, use_cache=True)
    if states is not None:
        states.extend(states_of(cache))
    return layers_of(cache)


def state_bytes(states) -> int:
    """Bytes of a row's recurrent states: probed_layers' `states` (a row)."""
    return sum(part.numel() * part.element_size() for state in states for part in state if part is not None)


def token_bytes(layers) -> int:
    """Bytes of keys/values one token position takes: probed_layers' `layers`."""
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)


def layer_shapes(layers) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """((kv heads, key size), (kv heads, value size)) of probed_layers' `layers`, the slots' shapes: a config's
    numbers do not say them where layers differ (Gemma 4's full layers' heads and sizes, its last layers reading
    earlier ones' keys)."""
    return [((k.shape[1], k.shape[3]), (v.shape[1], v.shape[3])) for k, v in layers]


def prefills_together(model) -> bool:
    """Whether requests go into their slots together (one pass), not each prefilled alone: unless
    RUN_GENERATION_PREFILL_TOGETHER=0 or --device_map spreads the model (offloaded layers too)."""
    return os.environ.get(PREFILL_ENV, "1") != "0" and len(devices_of(model)) <= 1


def devices_of(model) -> set:
    """The devices --device_map spread the model over, as named in its map (none: it was not)."""
    return {str(device) for device in (getattr(model, "hf_device_map", None) or {}).values()}


def own_cache(model, layers, length, states=()):
    """A cache of `layers` ([(keys, values)] a layer, emptied as each is copied in: one layer more at a time),
    standing for `length` positions (a sliding layer's: its last ones), and of its recurrent layers' `states`."""
    cache = new_cache(model)
    if states:
        put_states(cache, states)
    for number, layer in enumerate(holding(cache)):
        fill(layer, *layers[number], length)
        layers[number] = None
    return cache


def let_go(layer):
    """Drops a layer's keys/values (and the buffers a growing layer holds them in), its copy made."""
    layer.keys = layer.values = None
    if growing(layer):
        layer.buffers = None


def left_pad(tensor, width, dim=2):
    """Zeros before the tensor's entries along dim (the sequence) up to width."""
    missing = width - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)
