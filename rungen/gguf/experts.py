"""A mixture of experts' weights in the file's blocks: llama.cpp's 3-D ffn_{gate,up,down}_exps tensors as one
GGMLLinear per expert and product, where transformers' Experts module would hold them de-quantized (Qwen3-30B-A3B's
18 GB Q4_K_M file holds 115 GB of float32 experts).

An expert's gate and up rows are one product (one buffer a layer, expert by expert: gate rows, then up rows), as
transformers' concatenated gate_up_proj is (up alone for experts without a gate: Nemotron 3's); its down rows
another. The forward is transformers' Experts forward (`integrations/moe.py`): each token's hidden state through the
experts the router chose, weighted, summed. With the native kernels a whole mixture block (router, experts,
Qwen2-MoE's shared expert) is one call (NativeMixture), which the one-call decoder stack takes too. On a GPU
(build_model given a device) device_experts.py keeps them in codes (Qwen3-30B-A3B's Q4_K_M experts: 4-bit and int8
codes, where bfloat16 would take 58 GB); where a part's type has none there, dequantized_experts fills transformers'
own parameters, an expert at a time.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType

from .blocks import (
    GGMLLinear,
    GGMLParts,
    dequantize_to,
    interleavable,
    interleaved_row_bytes,
    native_products,
    weights_per_row,
)
from .kernels import native_kernels
from .weights import FLOAT_TYPES, GGUFError, Tensor, WeightReader, read_interleaved

# transformers' GELU modules of the tanh approximation (gelu_pytorch_tanh: Gemma 4's experts).
GELU_TANH = ("GELUTanh", "PytorchGELUTanh")
# rungen_ggml.chosen_experts' activations (csrc/ggml_ops.h's Activation): act(gate) * up, or relu(up)^2 alone.
SILU_GATED, GELU_GATED, RELU2 = 0, 1, 2
# The file's tensor for each part of transformers' Experts module.
PARTS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}


def holds_experts(module: torch.nn.Module) -> bool:
    """Whether `module` is a transformers Experts module of the layout GGMLExperts computes: not transposed, no
    biases, no norm after an expert, and either [gate; up] concatenated with the default gating (act(gate) * up) or
    up alone (act(up): Nemotron 3's)."""
    from transformers.integrations.moe import _default_apply_gate

    plain = (not getattr(module, "is_transposed", True) and not getattr(module, "has_bias", True)
             and not getattr(module, "has_post_expert_norm", True) and hasattr(module, "act_fn"))
    if getattr(module, "has_gate", None) is False:
        return plain and hasattr(module, "up_proj")
    return (plain and getattr(module, "is_concatenated", False) and getattr(module, "has_gate", False)
            and getattr(type(module), "_apply_gate", None) is _default_apply_gate)


def expert_products(module: torch.nn.Module) -> dict[str, tuple]:
    """A holds_experts module's two products by attribute, their shapes: {gate_up_proj or up_proj, down_proj}."""
    first = "gate_up_proj" if hasattr(module, "gate_up_proj") else "up_proj"
    return {first: tuple(getattr(module, first).shape), "down_proj": tuple(module.down_proj.shape)}


def part_of(name: str) -> str | None:
    """"gate", "up" or "down" for a layer's expert tensor's GGUF name (blk.N.ffn_gate_exps.weight), else None."""
    return PARTS.get(name.rsplit(".", 2)[-2]) if name.count(".") >= 2 else None


class ClampedSwiGLU(torch.nn.Module):
    """gpt-oss's gating of an expert's gate and up products (GptOssExperts._apply_gate on them apart): the gate
    clamped above at `limit`, up to +-`limit`, then (up + 1) * gate * sigmoid(alpha * gate)."""

    def __init__(self, alpha: float, limit: float):
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class GGMLExperts(torch.nn.Module):
    """A layer's experts over their blocks (on a GPU: over layers of codes, an expert's gate/up one and its down
    another): forward(hidden [tokens, hidden], top_k_index [tokens, k], top_k_weights [tokens, k]) as transformers'
    Experts modules compute it. gpt-oss's add biases ([experts, gate; up] and [experts, hidden]) after each product
    and gate by `gating(gate, up)` (ClampedSwiGLU) where the others take act_fn(gate) * up; experts without a gate
    (`gated` False: Nemotron 3's) hold up alone and take act_fn(up)."""

    def __init__(self, gate_up: list[torch.nn.Module], down: list[GGMLLinear], act_fn,
                 biases: tuple[torch.Tensor, torch.Tensor] | None = None, gating: torch.nn.Module | None = None,
                 gated: bool = True):
        super().__init__()
        self.gate_up, self.down, self.act_fn = torch.nn.ModuleList(gate_up), torch.nn.ModuleList(down), act_fn
        self.gate_up_bias, self.down_bias = biases if biases is not None else (None, None)
        self.gating, self.has_gate = gating, gated
        self.num_experts = len(down)
        # Each product's (blocks, code) an expert, where every expert's is one GGMLLinear (else None): what
        # mm_grouped takes, kept as lists (a step indexes them, not the modules).
        self.grouped = [[(layer.blocks, layer.code) for layer in layers]
                        if all(type(layer) is GGMLLinear for layer in layers) else None for layers in (gate_up, down)]
        # ([gate/up's parts' stacks..., down's stack], [their codes]) where every part's experts are views a fixed
        # step apart in one buffer (as build_experts reads them): what rungen_ggml.mixture takes; else None.
        parts = [list(layer.parts) if isinstance(layer, GGMLParts) else [layer] for layer in gate_up]
        columns = [[expert[i] for expert in parts] for i in range(len(parts[0]))] + [list(down)]
        stacks = [stacked(column) for column in columns] if len({len(p) for p in parts}) == 1 else [None]
        self.block_stacks = None if any(stack is None for stack in stacks) else (
            stacks, [column[0].code for column in columns])
        # Where the stacks are and the activation is one the native call has (no biases): the chosen experts in one
        # native call (rungen_ggml.chosen_experts), its activation; else None.
        self.native_activation = (native_activation(act_fn, gated) if self.block_stacks is not None
                                  and biases is None and gating is None else None)

    def extra_repr(self) -> str:
        first = self.down[0]
        form = first.qtype.name if hasattr(first, "qtype") else type(first).__name__
        return f"num_experts={self.num_experts}, hidden={first.out_features}, {form} (down)"

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if self.native_activation is not None and native_products():
            y = torch.ops.rungen_ggml.chosen_experts(hidden_states, top_k_index, top_k_weights, *self.block_stacks,
                                                     self.native_activation)
            return y.to(hidden_states.dtype)
        chosen = top_k_index.reshape(-1)
        order = torch.argsort(chosen, stable=True)  # the (token, slot) pairs grouped by expert, in token order
        counts = torch.bincount(chosen, minlength=self.num_experts).tolist()
        used = [(expert, count) for expert, count in enumerate(counts) if count]
        tokens = order // top_k_index.shape[-1]
        out = self._products(1, self.gated(self._products(0, hidden_states[tokens], used), chosen[order]), used)
        if self.down_bias is not None:
            out = out + self.down_bias[chosen[order]]
        done = out * top_k_weights.reshape(-1)[order, None]
        return torch.zeros_like(hidden_states).index_add_(0, tokens, done.to(hidden_states.dtype))

    def gated(self, gate_up: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The down products' input from gate/up products [rows, gate; up] whose rows are `experts`' ([rows]):
        act_fn(gate) * up, or gpt-oss's gating of them with its biases added; act_fn(up) without a gate."""
        if not self.has_gate:
            return self.act_fn(gate_up)
        if self.gate_up_bias is not None:
            gate_up = gate_up + self.gate_up_bias[experts]
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up if self.gating is None else self.gating(gate, up)

    def _products(self, which: int, x: torch.Tensor, used: list[tuple[int, int]]) -> torch.Tensor:
        """x's rows in groups (`used`: (expert, rows) in order), each group times that expert's gate/up (`which`
        0) or down (1): one call of the native kernels (rungen_ggml.mm_grouped) where every expert's is one
        GGMLLinear on them, else the layers one by one."""
        layers = (self.gate_up, self.down)[which]
        if not used:
            return x.new_zeros(0, layers[0].out_features)
        grouped = self.grouped[which]
        if grouped is not None and native_products():
            parts = [grouped[expert] for expert, _ in used]
            y = torch.ops.rungen_ggml.mm_grouped(x.float().contiguous(), [blocks for blocks, _ in parts],
                                                 [code for _, code in parts], [count for _, count in used],
                                                 layers[0].in_features)
            return y.to(x.dtype)
        return torch.cat([layers[expert](part)
                          for (expert, _), part in zip(used, x.split([count for _, count in used]))])


def stacked(layers: list[GGMLLinear]) -> torch.Tensor | None:
    """The layers' blocks as one stack [layers, rows, bytes], a view of the buffer they share (nothing copied), where
    each is a GGMLLinear of one code and shape a fixed step after the one before; else None."""
    if any(type(layer) is not GGMLLinear for layer in layers):
        return None
    first = layers[0].blocks
    if any(layer.code != layers[0].code or layer.bias is not None
           or layer.blocks.shape != first.shape or layer.blocks.stride() != first.stride()
           or layer.blocks.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() for layer in layers):
        return None
    step = layers[1].blocks.storage_offset() - first.storage_offset() if len(layers) > 1 else first.numel()
    if step <= 0 or any(layer.blocks.storage_offset() != first.storage_offset() + index * step
                        for index, layer in enumerate(layers)):
        return None
    return first.as_strided((len(layers), *first.shape), (step, *first.stride()), first.storage_offset())


# transformers' routers whose forward ExpertRouter computes (the same steps, the logits by RowProducts).
ROUTERS = ("Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "MixtralTopKRouter", "GptOssTopKRouter", "Qwen3_5MoeTopKRouter",
           "GraniteMoeHybridTopKRouter", "GraniteMoeTopKRouter", "GraniteMoeSharedTopKRouter", "OlmoeTopKRouter")
# Those of them whose weights are the softmax of the top k logits (gpt-oss's after its bias).
SOFTMAX_OF_TOP = ("GptOssTopKRouter", "GraniteMoeHybridTopKRouter", "GraniteMoeTopKRouter",
                  "GraniteMoeSharedTopKRouter")


class RowProducts(torch.nn.Module):
    """y = x @ weight.T for a float weight of few rows (a mixture's router, Qwen2-MoE's shared-expert gate), a row's
    bits the same in a batch of any size (rungen_ggml.dot_rows): torch's product of one row (a vector product) and
    of several differ in their last bits, and a router's near tie then picks other experts for a token in a batch
    than alone. torch's product where the native kernels are missing."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if native_kernels():
            y = torch.ops.rungen_ggml.dot_rows(flat, self.weight)
        else:
            y = torch.nn.functional.linear(flat, self.weight)
        return y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype)


class ExpertRouter(torch.nn.Module):
    """transformers' TopKRouter of ROUTERS, its logits by RowProducts: the softmax of the logits, the top k, those
    weights normalized where the config says so (SOFTMAX_OF_TOP's: gpt-oss's bias added, the top k logits, their
    softmax); (logits, weights, experts) as it returns them."""

    def __init__(self, router: torch.nn.Module):
        super().__init__()
        self.logits = RowProducts(router.weight)
        self.top_k, self.hidden_dim = router.top_k, router.weight.shape[-1]
        self.norm_topk_prob = getattr(router, "norm_topk_prob", True)  # Mixtral's has no flag: it always divides
        self.softmax_of_top = type(router).__name__ in SOFTMAX_OF_TOP
        self.bias = getattr(router, "bias", None) if self.softmax_of_top else None

    def forward(self, hidden_states: torch.Tensor):
        logits = self.logits(hidden_states.reshape(-1, self.hidden_dim))
        if self.softmax_of_top:
            logits = logits if self.bias is None else logits + self.bias
            top, experts = torch.topk(logits, self.top_k, dim=-1)
            return logits, torch.softmax(top, dim=-1, dtype=top.dtype), experts
        weights, experts = torch.topk(torch.softmax(logits, dtype=torch.float, dim=-1), self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), experts


def row_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """The sigmoid of `x`, a row's bits the same in a batch of any size: torch's sigmoid of a few rows parts by an
    ulp from a batch's (measured: rows of 8-60 values), exp's does not."""
    return 1 / (1 + torch.exp(-x))


# transformers' routers that choose within groups of experts, whose forward GroupedRouter computes: DeepSeek-V2's
# softmax, DeepSeek-V3's, GLM-4.5's and Nemotron 3's sigmoid with a correction.
GROUPED_ROUTERS = ("DeepseekV2TopkRouter", "DeepseekV3TopkRouter", "Glm4MoeTopkRouter", "NemotronHTopkRouter",
                   "Mistral4TopkRouter", "Dots1TopkRouter")


class GroupedRouter(torch.nn.Module):
    """transformers' router of GROUPED_ROUTERS, its logits by RowProducts. DeepSeek-V3's and GLM-4.5's: each
    expert's score the sigmoid of its logit; the top k experts by score plus its correction (e_score_correction_bias),
    among the topk_group best of n_group groups (a group by its two best) where there are several; their weights
    their scores, divided by their sum where norm_topk_prob says. DeepSeek-V2's: the softmax of the logits, the top k
    (group_limited_greedy: among the best groups, a group by its best), their weights their scores. Mistral 4's:
    the softmax's top k among the best groups by their two best, divided by their sum where norm_topk_prob says.
    Times routed_scaling_factor; (logits, weights, experts) as it returns them."""

    def __init__(self, router: torch.nn.Module):
        super().__init__()
        self.logits = RowProducts(router.weight.detach().float())
        self.correction = getattr(router, "e_score_correction_bias", None)  # (None: V2's softmax)
        self.top_k, self.hidden_dim = router.top_k, router.hidden_dim
        self.norm_topk_prob = getattr(router, "norm_topk_prob", False)
        self.groups, self.groups_used, self.scale = router.num_group, router.topk_group, router.routed_scaling_factor
        # (Mistral 4's: V3's groups, by their two best, over the softmax; its weights divided by their sum)
        self.best_two = self.correction is not None or type(router).__name__ == "Mistral4TopkRouter"
        if not self.best_two and router.topk_method != "group_limited_greedy":
            self.groups = 1

    def forward(self, hidden_states: torch.Tensor):
        logits = self.logits(hidden_states.reshape(-1, self.hidden_dim).float())
        if self.correction is None:
            scores = choice = torch.softmax(logits, dim=-1)
        else:
            scores = row_sigmoid(logits)
            choice = scores + self.correction
        if self.groups > 1:
            grouped = choice.view(-1, self.groups, choice.shape[-1] // self.groups)
            merit = grouped.topk(2, dim=-1)[0].sum(dim=-1) if self.best_two else grouped.max(dim=-1).values
            best = torch.topk(merit, k=self.groups_used, dim=-1, sorted=False)[1]
            kept = torch.zeros_like(merit, dtype=torch.bool).scatter_(1, best, True)
            dropped = 0.0 if self.correction is None else float("-inf")  # (Mistral 4's as V2's: 0)
            choice = grouped.masked_fill(~kept[..., None], dropped).view_as(choice)
        experts = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, weights * self.scale, experts


class BiasedRouter(torch.nn.Module):
    """LFM2-MoE's router (Lfm2MoeTopKRouter), AFMoE's (AfmoeTokenChoiceRouter), MiniMax-M2's (MiniMaxM2TopKRouter)
    and HY V3's (HYV3TopKRouter), its logits by RowProducts (in the weight's dtype): each expert's score the sigmoid
    of its logit; the top k by score plus the block's expert bias where it has one (given at each call, as the block
    gives it), their weights their scores, divided by their sum plus `eps` (LFM2-MoE's 1e-6 where norm_topk_prob
    says, AFMoE's and HY V3's 1e-20 always, MiniMax-M2's 0; None: not divided), times the scale; (logits, weights,
    experts) as it returns them."""

    def __init__(self, weight: torch.Tensor, top_k: int, scale: float, eps: float | None, biased: bool):
        super().__init__()
        self.logits = RowProducts(weight)
        self.top_k, self.scale, self.eps, self.biased = top_k, scale, eps, biased

    @classmethod
    def of(cls, router: torch.nn.Module) -> BiasedRouter:
        if type(router).__name__ == "AfmoeTokenChoiceRouter":
            return cls(router.gate.weight.detach().float(), router.top_k, router.route_scale, 1e-20, True)
        if type(router).__name__ == "MiniMaxM2TopKRouter":  # (divided by their sum alone, not scaled)
            return cls(router.weight.detach().float(), router.top_k, 1.0, 0.0, True)
        if type(router).__name__ == "HYV3TopKRouter":  # (its logits in float32)
            return cls(router.weight.detach().float(), router.top_k, router.router_scaling_factor, 1e-20, True)
        return cls(router.weight.detach(), router.top_k, router.routed_scaling_factor,
                   1e-6 if router.norm_topk_prob else None, router.use_expert_bias)

    def forward(self, hidden_states: torch.Tensor, expert_bias: torch.Tensor | None = None):
        weight = self.logits.weight
        logits = self.logits(hidden_states.reshape(-1, weight.shape[-1]).to(weight.dtype))
        scores = row_sigmoid(logits)
        if self.biased:
            experts = torch.topk(scores + expert_bias, k=self.top_k, dim=-1)[1]
            weights = torch.gather(scores, dim=1, index=experts)
        else:
            weights, experts = torch.topk(scores, k=self.top_k, dim=-1)
        if self.eps is not None:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + self.eps)
        return logits, weights * self.scale, experts


class ErnieRouter(torch.nn.Module):
    """ERNIE 4.5's router (Ernie4_5_MoeTopKRouter), its logits by RowProducts: the softmax of the logits; the top k
    by softmax plus its correction (moe_statics); their weights the softmax's, divided by their sum (at least
    moe_norm_min); (logits, weights, experts) as it returns them."""

    def __init__(self, router: torch.nn.Module):
        super().__init__()
        self.logits = RowProducts(router.weight.detach().float())
        self.correction = router.moe_statics.e_score_correction_bias
        self.top_k, self.norm_min = router.top_k, router.norm_min

    def forward(self, hidden_states: torch.Tensor):
        logits = self.logits(hidden_states.float())
        scores = torch.softmax(logits, dim=1, dtype=torch.float)
        experts = torch.topk(scores + self.correction.squeeze(), self.top_k, dim=-1)[1]
        weights = torch.gather(scores, dim=-1, index=experts)
        weights = weights / torch.clamp(weights.sum(dim=-1, keepdim=True), min=self.norm_min)
        return logits, weights.to(hidden_states.dtype), experts


# transformers' routers and the class that computes each a row at a time.
ROUTER_FORMS = {**dict.fromkeys(ROUTERS, ExpertRouter), **dict.fromkeys(GROUPED_ROUTERS, GroupedRouter),
                "Lfm2MoeTopKRouter": BiasedRouter.of, "Ernie4_5_MoeTopKRouter": ErnieRouter,
                "AfmoeTokenChoiceRouter": BiasedRouter.of, "MiniMaxM2TopKRouter": BiasedRouter.of,
                "HYV3TopKRouter": BiasedRouter.of}


# transformers' mixture blocks whose forward NativeMixture computes (Qwen2-MoE's and Qwen3.5-MoE's with their shared
# expert; gpt-oss's with its biases and clamped SwiGLU; Granite 4.0's, its shared MLP beside it in the layer).
GRANITE_BLOCKS = ("GraniteMoeHybridMoE", "GraniteMoeMoE", "GraniteMoeSharedMoE")
BLOCKS = ("Qwen2MoeSparseMoeBlock", "Qwen3MoeSparseMoeBlock", "MixtralSparseMoeBlock", "GptOssMLP",
          "Qwen3_5MoeSparseMoeBlock", "OlmoeSparseMoeBlock", *GRANITE_BLOCKS)
# Those in layers FusedDecoderLayer does not fuse, which MixtureInOneCall takes instead, by the layer's attribute
# holding them; and those that return the hidden state alone (the others a pair).
UNFUSED_BLOCKS = {"GptOssMLP": "mlp", "Qwen3_5MoeSparseMoeBlock": "mlp", "OlmoeSparseMoeBlock": "mlp",
                  **dict.fromkeys(GRANITE_BLOCKS, "block_sparse_moe")}
HIDDEN_ALONE = (*GRANITE_BLOCKS, "OlmoeSparseMoeBlock")


class NativeMixture:
    """A mixture block of BLOCKS over ExpertRouter and GGMLExperts in one native call (rungen_ggml.mixture): what the
    modules compute, within float32 rounding, without their forty torch operators, sort and read of each expert's
    count to the host a layer. Not a module: it holds the block's own tensors."""

    def __init__(self, router: torch.Tensor, top_k: int, norm_topk: bool, experts: GGMLExperts,
                 shared: tuple[GGMLLinear, GGMLLinear, GGMLLinear] | None = None,
                 shared_gate: torch.Tensor | None = None, router_bias: torch.Tensor | None = None):
        """router: the router's weight [experts, hidden] (float32) and bias; top_k experts a token, their weights
        divided by their sum where norm_topk; experts with stacks (GGMLExperts.block_stacks; gpt-oss's biases and
        ClampedSwiGLU taken from them); Qwen2-MoE's shared expert (its gate, up and down) and its gate's weight
        [1, hidden]."""
        self.router, self.top_k, self.norm_topk = router, int(top_k), bool(norm_topk)
        self.experts, self.expert_codes = experts.block_stacks
        self.router_bias, self.gate_up_bias, self.down_bias = router_bias, experts.gate_up_bias, experts.down_bias
        gating = experts.gating
        self.swiglu = (0.0, 0.0) if gating is None else (float(gating.alpha), float(gating.limit))
        self.shared = list(shared or ())
        # The shared expert as the stack takes it: gate and up as one product's parts, down; else None.
        self.shared_gate_up = None if shared is None else GGMLParts(list(shared[:2]))
        self.shared_down = None if shared is None else shared[2]
        self.shared_gate = shared_gate

    @classmethod
    def of(cls, block: torch.nn.Module) -> NativeMixture | None:
        """The native form of transformers' `block`, or None where it is not one this class computes (another
        block, experts not stacked in their blocks, an activation other than SiLU, a shared expert not in blocks)."""
        experts, shared = getattr(block, "experts", None), getattr(block, "shared_expert", None)
        router = getattr(block, "router" if hasattr(block, "router") else "gate", None)
        if (type(block).__name__ not in BLOCKS or not isinstance(router, ExpertRouter)
                or type(experts) is not GGMLExperts or experts.block_stacks is None
                or not (silu(experts.act_fn) if experts.gating is None else type(experts.gating) is ClampedSwiGLU)):
            return None
        if shared is not None and not (
                all(type(getattr(shared, name, None)) is GGMLLinear and getattr(shared, name).bias is None
                    for name in ("gate_proj", "up_proj", "down_proj"))
                and silu(shared.act_fn) and type(getattr(block, "shared_expert_gate", None)) is RowProducts):
            return None
        # (gpt-oss's softmax of the top k logits: the top k of the softmax, divided by their sum)
        return cls(router.logits.weight, router.top_k, router.norm_topk_prob or router.softmax_of_top, experts,
                   None if shared is None else (shared.gate_proj, shared.up_proj, shared.down_proj),
                   None if shared is None else block.shared_expert_gate.weight, router.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.rungen_ggml.mixture(x.reshape(-1, x.shape[-1]), self.router, self.top_k, self.norm_topk,
                                          self.experts, self.expert_codes, [p.blocks for p in self.shared],
                                          [p.code for p in self.shared], self.shared_gate, self.router_bias,
                                          self.gate_up_bias, self.down_bias, *self.swiglu)
        return y.view(x.shape).to(x.dtype)


class MixtureInOneCall(torch.nn.Module):
    """A mixture block of a layer FusedDecoderLayer does not fuse (UNFUSED_BLOCKS) as NativeMixture's one call where
    the products are the blocks' own (native_products), else the block's modules; (hidden, None) as gpt-oss's block
    returns (hidden, the router's scores), which generation does not read (Qwen3.5-MoE's layer takes either), the
    hidden state alone as HIDDEN_ALONE's blocks return it."""

    def __init__(self, block: torch.nn.Module, mixture: NativeMixture):
        super().__init__()
        self.block, self.mixture = block, mixture
        self.pair = type(block).__name__ not in HIDDEN_ALONE

    def forward(self, hidden_states: torch.Tensor):
        if not native_products():
            return self.block(hidden_states)
        hidden_states = self.mixture(hidden_states)
        return (hidden_states, None) if self.pair else hidden_states


def native_activation(act_fn, gated: bool = True) -> int | None:
    """rungen_ggml.chosen_experts' activation for experts of `act_fn`, gated or not; None where it has none."""
    name = type(act_fn).__name__
    if not gated:
        return RELU2 if name == "ReLUSquaredActivation" else None
    return GELU_GATED if name in GELU_TANH else SILU_GATED if silu(act_fn) else None


def silu(act_fn) -> bool:
    """Whether `act_fn` is transformers' (or torch's) SiLU module, or torch's function (LFM2-MoE's experts')."""
    return type(act_fn).__name__ in ("SiLUActivation", "SiLU") or act_fn is torch.nn.functional.silu


def mixtures_in_one_call(model: torch.nn.Module) -> None:
    """Each mixture block of UNFUSED_BLOCKS over GGMLExperts (gpt-oss's, Qwen3.5-MoE's, Granite 4.0's: layers
    FusedDecoderLayer leaves as they are) as MixtureInOneCall."""
    for layer in getattr(getattr(model, "model", None), "layers", []):
        for attribute, block in list(layer.named_children()):
            mixture = NativeMixture.of(block) if UNFUSED_BLOCKS.get(type(block).__name__) == attribute else None
            if mixture is not None:
                setattr(layer, attribute, MixtureInOneCall(block, mixture))


def route_rows_alike(model: torch.nn.Module) -> None:
    """Each mixture block over GGMLExperts gets its router's form of ROUTER_FORMS and RowProducts for Qwen2-MoE's
    shared-expert gate: a token takes the same experts, and the same bits, alone and in a
    batch."""
    for block in list(model.modules()):
        if not isinstance(getattr(block, "experts", None), GGMLExperts):
            continue
        for name in ("gate", "router"):  # (gpt-oss's is its router)
            router = ROUTER_FORMS.get(type(getattr(block, name, None)).__name__)
            if router is not None:
                setattr(block, name, router(getattr(block, name)))
        shared = getattr(block, "shared_expert_gate", None)
        if type(shared) is torch.nn.Linear and shared.bias is None:
            block.shared_expert_gate = RowProducts(shared.weight)


def _rows(reader: WeightReader, tensor: Tensor, experts: int, into: torch.Tensor | None = None
          ) -> tuple[list[torch.Tensor], bool]:
    """Each expert's rows of a 3-D tensor [experts, rows, row bytes]: interleaved where the kernels take them so
    (read into `into` [experts, rows / 8 + more, bytes] from row 0 when given, else a buffer of their own), else
    views of the map; and whether interleaved."""
    qtype = GGMLQuantizationType(tensor.code)
    _, rows, row_bytes = tensor.shape
    if not interleavable(qtype, rows):
        blocks = torch.from_numpy(reader.blocks(tensor))
        return [blocks[e] for e in range(experts)], False
    if into is None:
        into = torch.empty(experts, rows // 8, interleaved_row_bytes(qtype, weights_per_row(qtype, row_bytes)),
                           dtype=torch.uint8)
    for e in range(experts):
        one = reader.expert(tensor, e)
        read_interleaved(reader.path, one.offset, (rows, row_bytes), qtype, reader.scratch, out=into[e, :rows // 8],
                         name=one.name)
    return [into[e, :rows // 8] for e in range(experts)], True


def check_shapes(reader: WeightReader, parts: dict[str, Tensor], gate_up: tuple, down: tuple) -> None:
    """GGUFError where a layer's three expert tensors are not of the shapes an Experts module's gate_up_proj
    ([experts, gate; up, hidden]) and down_proj take (without a gate: its two, up_proj's [experts, up, hidden])."""
    count, inner, hidden = gate_up
    halves = [("gate", (count, inner // 2, hidden)), ("up", (count, inner // 2, hidden))] if "gate" in parts \
        else [("up", (count, inner, hidden))]
    for name, wanted in (*halves, ("down", tuple(down))):
        tensor = parts[name]
        if tensor.code in FLOAT_TYPES:
            shape = (tensor.shape[0], *reader.float_tensor(reader.expert(tensor, 0)).shape)
        else:
            shape = (*tensor.shape[:-1], weights_per_row(GGMLQuantizationType(tensor.code), tensor.shape[-1]))
        if shape != wanted:
            raise GGUFError(f"{reader.path}: tensor {tensor.name} holds {list(shape)} weights where the model "
                            f"takes {list(wanted)}")


def build_experts(reader: WeightReader, parts: dict[str, Tensor], gate_up_shape: tuple, down_shape: tuple,
                  act_fn: torch.nn.Module, biases: tuple[torch.Tensor, torch.Tensor] | None = None,
                  gating: torch.nn.Module | None = None) -> GGMLExperts:
    """The GGMLExperts of a layer's three expert tensors (`parts`: part_of's names), in place of an Experts module
    whose gate_up_proj and down_proj have these shapes ([experts, gate; up, hidden], [experts, hidden, inner]);
    GGUFError where the tensors' are not those. `biases` and `gating`: gpt-oss's (GGMLExperts). Experts without a
    gate (parts up and down, the first shape up_proj's) hold their up rows alone."""
    check_shapes(reader, parts, gate_up_shape, down_shape)
    gate, up, down = parts.get("gate"), parts["up"], parts["down"]
    experts = up.shape[0]
    width = {name: weights_per_row(GGMLQuantizationType(t.code), t.shape[-1]) for name, t in parts.items()}
    qtype = GGMLQuantizationType(up.code if gate is None else gate.code)
    if gate is None:
        ups, interleaved = _rows(reader, up, experts)
        gate_up = [GGMLLinear(u, qtype, width["up"], interleaved=interleaved) for u in ups]
    elif gate.code == up.code and interleavable(qtype, gate.shape[1]) and interleavable(qtype, up.shape[1]):
        both = torch.empty(experts, (gate.shape[1] + up.shape[1]) // 8, interleaved_row_bytes(qtype, width["gate"]),
                           dtype=torch.uint8)
        _rows(reader, gate, experts, both)
        _rows(reader, up, experts, both[:, gate.shape[1] // 8:])
        gate_up = [GGMLLinear(both[e], qtype, width["gate"], interleaved=True) for e in range(experts)]
    elif gate.code == up.code:  # rows the kernels take as the file has them (Q2_K): read into one buffer
        both = np.concatenate([reader.read(gate), reader.read(up)], axis=1)
        gate_up = [GGMLLinear(torch.from_numpy(both[e]), qtype, width["gate"]) for e in range(experts)]
    else:  # two types: each expert's gate and up as the parts of one product
        gates, gate_interleaved = _rows(reader, gate, experts)
        ups, up_interleaved = _rows(reader, up, experts)
        gate_up = [GGMLParts([GGMLLinear(g, qtype, width["gate"], interleaved=gate_interleaved),
                              GGMLLinear(u, up.code, width["up"], interleaved=up_interleaved)])
                   for g, u in zip(gates, ups)]
    downs, interleaved = _rows(reader, down, experts)
    down_layers = [GGMLLinear(d, down.code, width["down"], interleaved=interleaved) for d in downs]
    return GGMLExperts(gate_up, down_layers, act_fn, biases, gating, gated=gate is not None)


def dequantized_experts(reader: WeightReader, parts: dict[str, Tensor], module: torch.nn.Module, dtype: torch.dtype,
                        device: torch.device) -> dict[str, torch.Tensor]:
    """`module`'s gate_up_proj [experts, gate; up, hidden] (without a gate: up_proj) and down_proj from a layer's
    expert tensors, by attribute, de-quantized to `dtype` on `device` an expert at a time, a chunk of rows at a time
    (dequantize_to): never the layer's experts in float32 on the host (Qwen3-30B-A3B's are 2.4 GB a layer)."""
    shapes = expert_products(module)
    first = next(iter(shapes))
    check_shapes(reader, parts, shapes[first], shapes["down_proj"])
    count, inner, hidden = shapes[first]
    gate_up = torch.empty(count, inner, hidden, dtype=dtype, device=device)
    down = torch.empty(shapes["down_proj"], dtype=dtype, device=device)
    for e in range(count):
        halves = ((parts["gate"], gate_up[e, :inner // 2]), (parts["up"], gate_up[e, inner // 2:])) \
            if "gate" in parts else ((parts["up"], gate_up[e]),)
        for tensor, out in (*halves, (parts["down"], down[e])):
            one = reader.expert(tensor, e)
            if tensor.code in FLOAT_TYPES:
                out.copy_(reader.float_tensor(one))
            else:
                dequantize_to(reader.blocks(one), GGMLQuantizationType(tensor.code), out.shape[-1], dtype, device,
                              out=out)
    return {first: gate_up, "down_proj": down}



def gpt_oss_dequantized(reader: WeightReader, parts: dict[str, Tensor], biases: dict[str, Tensor],
                        module: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """gpt-oss's Experts parameters (gate_up_proj [experts, hidden, gate and up interleaved], down_proj [experts,
    inner, hidden], their biases) from a layer's expert tensors and biases, de-quantized to `dtype` on `device` an
    expert at a time."""
    count, hidden, inner = module.gate_up_proj.shape
    check_shapes(reader, parts, (count, inner, hidden), (count, hidden, inner // 2))

    def values(tensor: Tensor) -> torch.Tensor:
        if tensor.code in FLOAT_TYPES:
            return reader.float_tensor(tensor).to(device, dtype)
        qtype = GGMLQuantizationType(tensor.code)
        return dequantize_to(reader.blocks(tensor), qtype, weights_per_row(qtype, tensor.shape[-1]), dtype, device)

    out = {"gate_up_proj": torch.empty(count, hidden, inner, dtype=dtype, device=device),
           "down_proj": torch.empty(count, inner // 2, hidden, dtype=dtype, device=device),
           "gate_up_proj_bias": torch.empty(count, inner, dtype=dtype, device=device),
           "down_proj_bias": values(biases["down_bias"])}
    for e in range(count):
        out["gate_up_proj"][e, :, 0::2] = values(reader.expert(parts["gate"], e)).T
        out["gate_up_proj"][e, :, 1::2] = values(reader.expert(parts["up"], e)).T
        out["down_proj"][e] = values(reader.expert(parts["down"], e)).T
    out["gate_up_proj_bias"][:, 0::2], out["gate_up_proj_bias"][:, 1::2] = (values(biases["gate_bias"]),
                                                                            values(biases["up_bias"]))
    return out
