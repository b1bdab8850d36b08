"""What transformers' Llama 4 classes need over a GGUF file's blocks. Its mixture (Llama4TextMoe) holds its experts
transposed ([experts, hidden, gate; up]) in a module of its own, which the file's blocks cannot stand in for: built on
meta before the file's weights come, Llama4Mixture keeps its router and shared expert and holds the experts as
transformers' Experts modules do ([experts, gate; up, hidden]: build.py's GGMLExperts then), and computes what
Llama4TextMoe does, each token's input scaled by its expert's score before that expert. Its model moves the input
ids to its embedding's weight's device: a quantized embedding's blocks (or codes) stand for that weight.
"""

from __future__ import annotations

import torch

from .experts import RowProducts, row_sigmoid


class Llama4Mixture(torch.nn.Module):
    """Llama4TextMoe's forward over an Experts module: the router's top k logits of a token (its logits by
    RowProducts: the same experts alone and in a batch), each one's sigmoid its score, the token's input times that
    score through the expert, summed, plus the shared expert's output; (output in the input's shape, logits) as the
    block returns them."""

    def __init__(self, block: torch.nn.Module, experts: torch.nn.Module):
        super().__init__()
        self.router, self.shared_expert, self.experts = block.router, block.shared_expert, experts
        self.top_k, self.hidden_dim = block.top_k, block.hidden_dim
        self.logits = None  # RowProducts over the router's weight, once the file's is in

    def forward(self, hidden_states: torch.Tensor):
        x = hidden_states.reshape(-1, self.hidden_dim)
        if self.logits is None:
            self.logits = RowProducts(self.router.weight)
        logits = self.logits(x)
        top, chosen = torch.topk(logits, self.top_k, dim=-1)
        scores = row_sigmoid(top.float()).to(x.dtype)
        out, once = self.shared_expert(x), torch.ones_like(scores[:, :1])
        for k in range(self.top_k):  # (the published models take one expert a token)
            out = out + self.experts(x * scores[:, k : k + 1], chosen[:, k : k + 1], once)
        return out.view(hidden_states.shape), logits


def llama4_mixtures(model: torch.nn.Module) -> None:
    """Each Llama4TextMoe of `model` (on meta) as a Llama4Mixture over an Experts module of its shapes (Mixtral's
    class: gate and up concatenated, SiLU, no bias); nothing for other models."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    for layer in getattr(getattr(model, "model", None), "layers", []):
        block = getattr(layer, "feed_forward", None)
        if type(block).__name__ != "Llama4TextMoe":
            continue
        text = model.config
        shape = MixtralConfig(num_local_experts=text.num_local_experts, hidden_size=text.hidden_size,
                              intermediate_size=text.intermediate_size, hidden_act=text.hidden_act)
        shape._experts_implementation = "eager"  # (float experts: the class's own loop over the chosen ones)
        with torch.device("meta"):
            layer.feed_forward = Llama4Mixture(block, MixtralExperts(shape))


def llama4_lookup(model: torch.nn.Module) -> None:
    """A Llama 4 model's embedding without a weight (GGMLEmbedding, a device's codes) given its first tensor (its
    blocks, its codes) as the weight its model reads the device of; nothing for other models."""
    embedding = model.get_input_embeddings()
    if type(model).__name__ == "Llama4ForCausalLM" and not hasattr(embedding, "weight"):
        embedding.weight = next(iter([*embedding.buffers(), *embedding.parameters()]))
