"""A key/value cache in fixed slots for the engine's batch on transformers' models of FAMILIES: per layer one keys
and one values tensor [slots, kv heads, positions, head size], grown by copying only when outgrown. A row owns a
slot; a decode step writes its position in place and attention reads a view of the first `length` positions of the
first `rows` slots, so nothing is concatenated and a step's shapes depend only on (rows, length): it can be a CUDA
graph. A row that ends frees its slot to the last row, so rows stay 0..rows-1. The mask is 4D [rows, 1, queries,
length], which transformers' mask construction passes through: boolean for sdpa, additive (0 or the dtype's least)
for eager attention, which adds it to the scores; with a sliding window (Mistral's, Phi-3's, and the layers a config's
layer_types names sliding: Gemma 2 and 3, gpt-oss, Qwen2's) a position sees only the window's last keys (the mask
applies the window). A sliding layer holds a ring of `ring` positions (the window, a prefill's pass and the step ahead,
rounded up): position p at p % ring, so that a long context's sliding layers hold no more than that; until a row's
positions reach the ring it is read as a full layer, and past them whole, under a mask that works out each entry's
position from the row's last one (ring_mask).
"""

from __future__ import annotations

import torch

from .errors import out_of_device_memory
from .sinks_attention import SINKS_ATTENTION
from .transfers import to_device

# The families whose attention takes this cache and a 4D mask as transformers writes them (update(k, v, layer)); a
# config with layer_types takes a dict of masks by layer type, one without a mask for every layer.
# (Gemma 4's layers differ in heads and sizes, its last ones reading earlier ones' keys: the slots take each layer's
# shapes as a pass writes them, rungen/batch_cache.py's layer_shapes.)
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "smollm3", "gemma2", "gemma3_text", "gemma4_text",
            # and others of transformers' models whose attention does the same (tests/test_slots.py, each
            # against generate())
            "gemma", "granite", "olmo", "olmo2", "olmo3", "cohere", "cohere2", "starcoder2", "phi", "exaone4",
            "ernie4_5", "seed_oss", "apertus", "arcee", "stablelm", "glm", "glm4", "internlm3", "helium",
            "hunyuan_v1_dense", "nemotron", "bitnet", "ministral", "ministral3", "vaultgemma", "granite_swa", "cwm",
            "jais2", "iquestcoder", "hyperclovax", "nanochat", "doge", "diffllama", "flint", "gemma4_unified_text",
            # the older ones the original script served (GPT-2 its default; Falcon's rotary models)
            "gpt2", "gpt_neox", "gptj", "codegen", "gpt_bigcode", "falcon", "opt", "mpt", "xglm", "biogpt")
# Mixtures of experts of those attentions (gpt-oss's with sinks); a mixture of any family (Gemma 4's 26B-A4B) is
# taken where every layer's experts read nothing back to the host at a decode step (reads_nothing_back).
MIXTURES = ("qwen2_moe", "qwen3_moe", "mixtral", "gpt_oss", "olmoe", "flex_olmo", "granitemoe", "phimoe", "glm4_moe",
            "hunyuan_v1_moe", "ernie4_5_moe", "exaone_moe", "cohere2_moe", "afmoe", "solar_open")
ROW_BUCKET = 8  # past 4 rows, a captured step's rows (and the slots) come in multiples of this
POSITION_BUCKET = 256  # the positions a slot holds, and those a step reads, in multiples of this


def round_up(value: int, step: int) -> int:
    return -(-value // step) * step


def reads_nothing_back(experts: torch.nn.Module) -> bool:
    """Whether a mixture's Experts module reads nothing back to the host at a decode step (its step may be a CUDA
    graph, and launched ahead): a GPU's experts in codes (captures_decode, rungen/gguf/device_experts.py), or
    transformers' own in their grouped_mm form (its default), which finds each expert's rows on the device, where its
    grouped product runs (the CPU; a CUDA GPU from compute capability 8.0: before, each group is read back). Their
    eager form reads which experts a step chose."""
    if getattr(experts, "captures_decode", False):
        return True
    if getattr(getattr(experts, "config", None), "_experts_implementation", None) != "grouped_mm":
        return False
    device = next(experts.parameters()).device
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 0)


def takes_slots(model: torch.nn.Module) -> bool:
    """Whether `model` runs on a SlotCache: a transformers model of FAMILIES or MIXTURES whose experts (if any) read
    nothing back at a step, full or sliding-window attention on every layer, sdpa, eager or gpt-oss's sinks
    attention, no ALiBi bias of Falcon's, and no other cache of its own (the own model, fused GGUF layers, --jit)."""
    config = getattr(model, "config", None)
    if config is None or any(getattr(model, flag, False) for flag in ("own_cache", "cache_grows_in_place",
                                                                         "traced_step")):
        return False
    text = config.get_text_config(decoder=True)
    experts = [module for module in model.modules() if type(module).__name__.endswith("Experts")]
    if not all(reads_nothing_back(module) for module in experts):
        return False
    if text.model_type not in FAMILIES and not (text.model_type in MIXTURES and experts):
        return False
    if getattr(text, "alibi", False):  # (Falcon's ALiBi models: their bias is built from a 2D mask)
        return False
    if getattr(text, "_attn_implementation", None) not in ("sdpa", "eager", SINKS_ATTENTION):
        return False
    kinds = getattr(text, "layer_types", None)
    return kinds is None or set(kinds) <= {"full_attention", "sliding_attention"}


def ring_mask(size: int, ends: torch.Tensor, positions: torch.Tensor, window: int) -> torch.Tensor:
    """Which entries of a ring of `size` positions each query at `positions` [rows, queries] sees [rows, 1, queries,
    size]: entry j holds the row's latest position at j modulo `size`, counted back from its last one written,
    ends [rows]; seen where that position is written (>= 0), not past the query and within its window."""
    held = ends[:, None] - (ends[:, None] - torch.arange(size, device=ends.device)) % size  # [rows, size]
    held, queries = held[:, None, None, :], positions[:, None, :, None]
    return (held >= 0) & (held <= queries) & (held > queries - window)


class AttentionMask:
    """What a model's attention takes for a causal mask over the slots: `kinds` the config's layer_types (None: one
    mask for every layer), `window` its sliding window where a layer slides (None: none does), `additive` whether its
    attention adds the mask to the scores (eager) rather than taking a boolean one (sdpa)."""

    def __init__(self, text_config):
        self.kinds = getattr(text_config, "layer_types", None)
        slides = "sliding_attention" in self.kinds if self.kinds is not None else True
        window = getattr(text_config, "sliding_window", None) or None  # (Qwen2-MoE's 0: none)
        self.window = window if slides else None
        self.additive = getattr(text_config, "_attn_implementation", None) == "eager"

    def __call__(self, seen: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, ring=None
                 ) -> torch.Tensor | dict:
        """`seen` [rows, 1, queries, length] (a query sees the slot's positions up to its own, at `positions`
        [rows, queries]) as the model takes it, additive masks in `dtype`; `ring` (size, ends): the sliding layers
        read whole rings of that size, each row's last position written at ends [rows] (ring_mask)."""
        masks = {"full_attention": seen}
        if self.window is not None and ring is not None:
            masks["sliding_attention"] = ring_mask(*ring, positions, self.window)
        elif self.window is not None:  # transformers' window: a key more than `window - 1` positions back is out
            recent = torch.arange(seen.shape[-1], device=seen.device) > positions[:, None, :, None] - self.window
            masks["sliding_attention"] = seen & recent
        if self.additive:
            least = torch.finfo(dtype).min
            masks = {kind: torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, least)
                     for kind, mask in masks.items()}
        if self.kinds is None:
            return masks["sliding_attention" if self.window is not None else "full_attention"]
        return masks


class SlotCache:
    """The batch's keys/values in slots: the engine calls prepare() before a step, attention update() per layer."""

    def __init__(self, layers: int, max_slots: int, max_positions: int, attention_mask: AttentionMask | None = None,
                 ring: int | None = None):
        self.num_layers, self.max_slots, self.max_positions = layers, max_slots, max_positions
        self.attention_mask = attention_mask or AttentionMask(None)
        # The positions a sliding layer holds (None: every position, as a full layer does)
        self.ring = ring if self.attention_mask.window is not None else None
        self.keys, self.values = [], []  # per layer [slots, kv heads, capacity (a ring's: its size), head size]
        self.capacity = 0  # the positions a full layer holds
        self.rows = 0  # the slots in use: 0..rows-1
        self.slot_index = self.positions = None  # the step's rows [rows] and the position each writes [rows]
        self.length = 0  # positions a step reads
        self.generation = 0  # counts the times the buffers were replaced (graphs over older ones are stale)

    @classmethod
    def for_model(cls, model: torch.nn.Module, max_slots: int, max_positions: int, most_pass: int | None = None
                  ) -> SlotCache:
        """The slots for `model`, which takes them (takes_slots); `most_pass`: the sliding layers hold rings, a pass
        writing that many positions at most (its tokens and the step ahead), rounded up to POSITION_BUCKET past the
        window."""
        text = model.config.get_text_config(decoder=True)
        mask = AttentionMask(text)
        ring = round_up(mask.window + most_pass, POSITION_BUCKET) if most_pass and mask.window else None
        return cls(text.num_hidden_layers, max_slots, max_positions, mask, ring)

    def slides(self, layer: int) -> bool:
        """Whether `layer` holds a ring (a sliding layer, where the slots keep rings)."""
        kinds = self.attention_mask.kinds
        return self.ring is not None and (kinds is None or kinds[layer] == "sliding_attention")

    def ring_read(self, length: int) -> int | None:
        """The rings' size where a step reading `length` positions reads the sliding layers' rings whole (past their
        size), else None (each reads its first `length`, as a full layer does)."""
        size = min(self.capacity, self.ring) if self.ring is not None else None
        return size if size is not None and length > size else None

    @property
    def slots(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    def ensure(self, rows: int, positions: int, like: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Room for `rows` slots of `positions` positions each, in the dtype, device and head shapes of `like` (a
        layer list [(keys, values)]); grown to the rows' bucket (the rows a captured step runs: one prompt takes one
        slot), copying what the slots in use hold."""
        if rows <= self.slots and positions <= self.capacity:
            return
        self.num_layers = len(like)  # (the layers that hold keys and values: Gemma 4's last ones read earlier ones')
        slots = min(max(self.slots, rows_bucket(rows)), max(rows, rows_bucket(self.max_slots)))
        capacity = max(self.capacity, min(round_up(positions, POSITION_BUCKET), max(positions, self.max_positions)))
        keys, values = [], []
        for layer, (k, v) in enumerate(like):
            size = min(capacity, self.ring) if self.slides(layer) else capacity
            new_k = k.new_zeros((slots, k.shape[1], size, k.shape[3]))
            new_v = v.new_zeros((slots, v.shape[1], size, v.shape[3]))
            if self.keys and self.rows:  # (a ring that grows has not wrapped: each position where it was)
                held = self.keys[layer].shape[2]
                new_k[: self.rows, :, :held].copy_(self.keys[layer][: self.rows])
                new_v[: self.rows, :, :held].copy_(self.values[layer][: self.rows])
            keys.append(new_k)
            values.append(new_v)
        self.keys, self.values, self.capacity = keys, values, capacity
        self.generation += 1

    def write(self, slot: int, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """A joining row's prefilled keys/values (per layer [1, kv heads, length, head size], or a ring as
        row_layers gave it) into `slot`."""
        for layer, (k, v) in enumerate(layers):
            length, size = k.shape[2], self.keys[layer].shape[2]
            if length <= size:  # (positions 0..length-1, or a ring whole: each entry where it was)
                self.keys[layer][slot, :, :length].copy_(k[0])
                self.values[layer][slot, :, :length].copy_(v[0])
            else:  # every position, into a ring: the last `size` at their remainders
                at = torch.arange(length - size, length, device=k.device) % size
                self.keys[layer][slot, :, at] = k[0, :, length - size:]
                self.values[layer][slot, :, at] = v[0, :, length - size:]

    def move(self, source: int, target: int, length: int) -> None:
        """The first `length` positions of slot `source` into slot `target` (a row leaving frees its slot; a ring
        whole past its size)."""
        for keys, values in zip(self.keys, self.values):
            keys[target, :, :length].copy_(keys[source, :, :length])
            values[target, :, :length].copy_(values[source, :, :length])

    def row_layers(self, slot: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Views of the first `length` positions of `slot`, per layer [1, kv heads, length, head size] (a ring that
        `length` passes: whole, [1, kv heads, its size, head size])."""
        return [(k[slot : slot + 1, :, :length], v[slot : slot + 1, :, :length])
                for k, v in zip(self.keys, self.values)]

    def clear(self) -> None:
        self.keys, self.values, self.rows, self.capacity = [], [], 0, 0
        self.generation += 1

    def step_length(self, longest: int) -> int:
        """The positions a step reads when its furthest row writes at `longest`."""
        return min(self.capacity, round_up(longest + 1, POSITION_BUCKET))

    def prepare(self, positions: torch.Tensor, length: int) -> torch.Tensor:
        """Sets up a decode step of slots 0..len(positions)-1, each writing at its entry of `positions` (on the
        device) and reading `length` positions; returns the positions each row sees [rows, 1, 1, length] (boolean;
        attention_mask makes it the model's mask)."""
        self.length, self.positions = length, positions
        self.slot_index = torch.arange(positions.shape[0], device=positions.device)
        filled = torch.arange(length, device=positions.device)[None, :] <= positions[:, None]
        return filled[:, None, None, :]

    # -- what transformers' attention calls ----------------------------------------------------------------

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        size = keys.shape[2]
        at = self.positions % size if size < self.capacity else self.positions  # (a ring: at the remainder)
        keys[self.slot_index, :, at] = key_states[:, :, 0].to(keys.dtype)
        values[self.slot_index, :, at] = value_states[:, :, 0].to(values.dtype)
        rows, length = self.slot_index.shape[0], min(self.length, size)
        return keys[:rows, :, :length], values[:rows, :, :length]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def __len__(self) -> int:
        return self.num_layers


def decode_step(model: torch.nn.Module, cache: SlotCache, tokens: torch.Tensor, positions: torch.Tensor,
                length: int) -> torch.Tensor:
    """One decode step of slots 0..rows-1 (tokens [rows, 1], positions [rows]): the logits [rows, vocabulary] of
    their next tokens, in float32."""
    size = cache.ring_read(length)
    mask = cache.attention_mask(cache.prepare(positions, length), positions[:, None], cache.keys[0].dtype,
                                None if size is None else (size, positions))
    output = model(input_ids=tokens, attention_mask=mask, position_ids=positions[:, None], past_key_values=cache,
                   use_cache=True)
    return output.logits[:, -1].float()


class SlotPrefill:
    """The cache a prefill of several prompts at once sees: prompt b's tokens go to slot first + b at its positions
    [rows, tokens] (right-padded: a padding token's position lies past its prompt's end, where the row's own steps
    write before anything reads it), and attention reads the first `length` positions of those slots under the mask
    [rows, 1, tokens, length] (a position sees the slot's positions up to its own: the prompt's prefix and itself)."""

    def __init__(self, cache: SlotCache, first: int, positions: torch.Tensor, length: int):
        self.cache, self.first, self.positions, self.length = cache, first, positions, length
        rows = positions.shape[0]
        self.slot_index = torch.arange(first, first + rows, device=positions.device)[:, None]

    def mask(self) -> torch.Tensor | dict:
        seen = torch.arange(self.length, device=self.positions.device)[None, None, :] <= self.positions[:, :, None]
        size = self.cache.ring_read(self.length)  # (a ring: each row's last position, its padding's included)
        ring = None if size is None else (size, self.positions.amax(dim=1))
        return self.cache.attention_mask(seen[:, None], self.positions, self.cache.keys[0].dtype, ring)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = self.cache.keys[layer_idx], self.cache.values[layer_idx]
        size = keys.shape[2]
        at = self.positions % size if size < self.cache.capacity else self.positions  # (a ring: at the remainder)
        keys[self.slot_index, :, at] = key_states.transpose(1, 2).to(keys.dtype)
        values[self.slot_index, :, at] = value_states.transpose(1, 2).to(values.dtype)
        end, length = self.first + self.positions.shape[0], min(self.length, size)
        return keys[self.first : end, :, :length], values[self.first : end, :, :length]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def __len__(self) -> int:
        return self.cache.num_layers


def prefill_step(model: torch.nn.Module, cache: SlotCache, first: int, prompts: list[list[int]], starts: list[int],
                 device: torch.device) -> torch.Tensor:
    """Prefills prompt b's tokens `prompts[b]` into slot first + b from position starts[b] (what precedes is in the
    slot already: a prefix cache's keys/values), all in one forward pass; returns the logits [prompts, vocabulary] of
    each prompt's next token, in float32 (the head runs on those positions alone)."""
    widest = max(len(tokens) for tokens in prompts)
    ids = to_device([tokens + [0] * (widest - len(tokens)) for tokens in prompts], device)
    starts_on = to_device(starts, device)
    # Padding positions run on past each prompt's end; the slots' last position takes any beyond their capacity.
    positions = (starts_on[:, None] + torch.arange(widest, device=device)[None, :]).clamp(max=cache.capacity - 1)
    length = max(start + len(tokens) for start, tokens in zip(starts, prompts))
    view = SlotPrefill(cache, first, positions, length)
    hidden = model.get_decoder()(input_ids=ids, attention_mask=view.mask(), position_ids=positions,
                                 past_key_values=view, use_cache=True).last_hidden_state
    lasts = to_device([len(tokens) - 1 for tokens in prompts], device)
    chosen = hidden[torch.arange(len(prompts), device=device), lasts]
    return model.get_output_embeddings()(chosen[:, None]).float()[:, 0]


def release_default_generator() -> None:
    """A capture that failed before its end leaves the GPU's default generator marked as capturing, and every random
    draw on the GPU after it fails ("Offset increment outside graph capture"): a copy of its state (seed, offset)
    takes its place."""
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    try:
        generator.graphsafe_set_state(generator.clone_state())
    except RuntimeError:  # a torch without graph-safe states: the draws fail as they would have
        pass


def captured_rows(model: torch.nn.Module) -> int | None:
    """The rows a decode step of `model` may be captured for at most (None: any): a mixture's experts to their
    most_pairs (token, expert) pairs, a token taking num_experts_per_tok (the GEMV kernels' grouped launch; more
    step eagerly, on the tiled kernels' grouped launch)."""
    pairs = [module.most_pairs for module in model.modules() if getattr(module, "captures_decode", False)]
    if not pairs:
        return None
    return min(pairs) // model.config.get_text_config(decoder=True).num_experts_per_tok


def rows_bucket(rows: int) -> int:
    """The rows a captured step runs for `rows` (1, 2, 4, then multiples of ROW_BUCKET): padding rows write
    position 0 of free slots, which a row's prefill overwrites when it takes one."""
    return 1 << (rows - 1).bit_length() if rows <= ROW_BUCKET // 2 else round_up(rows, ROW_BUCKET)


class DecodeGraphs:
    """decode_step as CUDA graphs, one per (rows bucket, length bucket), captured on first use: a step's hundreds
    of launches become one. The returned logits are the rows bucket's output buffer, which every graph of that
    bucket writes last (outside the graphs' pool, so that no graph holds logits of its own there), read before the
    next replay; graphs are remade when the buffers are replaced; a failed capture warns and steps run eagerly (out
    of GPU memory, only those the graph would have run, until the buffers are replaced). `compiled`: the step
    captured is torch.compile's (inductor fuses the norms', rotary's and activation's elementwise operators; its
    shapes dynamic, so rows 1, rows past 1, and a step reading the whole slot compile once each, at their first
    capture). `step`: the eager step captured (decode_step's signature: transformers' layers, or the fused ones).
    A mixture's steps past captured_rows run eagerly (its experts then read each expert's tokens on the host)."""

    def __init__(self, model: torch.nn.Module, cache: SlotCache, compiled: bool = False, step=decode_step):
        self.model, self.cache, self.compiled, self.plain = model, cache, compiled, step
        self.most_rows = captured_rows(model)  # past them steps run eagerly (a mixture's experts read the host)
        self.step = torch.compile(step, dynamic=True) if compiled else step
        self.graphs, self.generation, self.pool = {}, None, None
        self.outputs = {}  # rows bucket -> its logits [bucket, vocabulary]
        self.failed = False
        self.short = set()  # the (rows bucket, length) whose capture ran out of GPU memory
        self.capture_seconds = 0.0

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, longest: int) -> torch.Tensor:
        rows, length = tokens.shape[0], self.cache.step_length(longest)
        bucket = rows_bucket(rows)
        if self.failed or bucket > self.cache.slots or (self.most_rows is not None and bucket > self.most_rows):
            return self.plain(self.model, self.cache, tokens, positions, length)
        if self.generation != self.cache.generation:
            self.graphs, self.short, self.generation = {}, set(), self.cache.generation
        graph = self.graphs.get((bucket, length))
        if graph is None:
            graph = None if (bucket, length) in self.short else self.capture(bucket, length, tokens, positions)
            if graph is None:
                return self.plain(self.model, self.cache, tokens, positions, length)
        cuda_graph, static_tokens, static_positions, logits = graph
        static_tokens.zero_()
        static_positions.zero_()
        static_tokens[:rows].copy_(tokens)
        static_positions[:rows].copy_(positions)
        cuda_graph.replay()
        return logits[:rows]

    def capture(self, bucket: int, length: int, tokens: torch.Tensor, positions: torch.Tensor):
        import time

        start, stream = time.perf_counter(), torch.cuda.current_stream()
        try:
            static_tokens = tokens.new_zeros((bucket, 1))
            static_positions = positions.new_zeros(bucket)
            static_tokens[: tokens.shape[0]].copy_(tokens)
            static_positions[: tokens.shape[0]].copy_(positions)
            side = torch.cuda.Stream()
            side.wait_stream(stream)
            with torch.cuda.stream(side):  # warm-up (and compilation): the same writes the step makes
                warm = self.step(self.model, self.cache, static_tokens, static_positions, length)
            stream.wait_stream(side)
            output = self.outputs.get(bucket)
            if output is None:
                output = self.outputs[bucket] = torch.empty(warm.shape, dtype=warm.dtype, device=warm.device)
            del warm
            if not self.graphs:  # a pool whose graphs are all gone takes no capture (CUDA's allocator asserts)
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                output.copy_(self.step(self.model, self.cache, static_tokens, static_positions, length))
        except Exception as error:  # any failure: eager steps, the same tokens
            import logging

            torch.cuda.set_stream(stream)  # a capture that failed to end leaves its own stream current
            release_default_generator()
            why = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            if out_of_device_memory(error):  # the other batches keep their graphs
                logging.getLogger("run_generation").warning(
                    "CUDA graphs: out of GPU memory to capture the decode step of %d rows (%s); those steps run "
                    "without a graph", bucket, why)
                self.short.add((bucket, length))
                return None
            logging.getLogger("run_generation").warning(
                "CUDA graphs: %s the decode step failed (%s); decoding without them",
                "compiling or capturing" if self.compiled else "capturing", why)
            self.failed = True
            return None
        self.capture_seconds += time.perf_counter() - start
        self.graphs[bucket, length] = graph, static_tokens, static_positions, output
        return self.graphs[bucket, length]
