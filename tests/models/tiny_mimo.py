"""A tiny MiMo checkpoint: a random Qwen2 (Hugging Face's, so the target can be checked against
it) plus random ``model.mtp_layers.{i}.*`` tensors, saved as ``config.json`` + safetensors.

``config.json`` says ``architectures: ["MiMoForCausalLM"]`` and ``num_nextn_predict_layers``, as
MiMo's does, but keeps ``model_type: "qwen2"`` (the real one is "mimo" with remote code), so
``transformers`` reads it without ``trust_remote_code``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor
from transformers import Qwen2Config, Qwen2ForCausalLM

VOCAB_SIZE = 128
MTP_LAYER_LEAVES = (
    "token_layernorm.weight",
    "hidden_layernorm.weight",
    "input_proj.weight",
    "final_layernorm.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.q_proj.bias",
    "self_attn.k_proj.weight",
    "self_attn.k_proj.bias",
    "self_attn.v_proj.weight",
    "self_attn.v_proj.bias",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)


def tiny_mimo_config(tie_word_embeddings: bool = False) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        tie_word_embeddings=tie_word_embeddings,
    )


def mtp_layer_tensors(config: Qwen2Config, generator: torch.Generator) -> dict[str, Tensor]:
    """One MTP layer's tensors by leaf name: N(0, 0.1) matrices and biases, norms 1 + N(0, 0.1)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = hidden // config.num_attention_heads
    q_size, kv_size = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    shapes = {
        "input_proj.weight": (hidden, 2 * hidden),
        "self_attn.q_proj.weight": (q_size, hidden),
        "self_attn.q_proj.bias": (q_size,),
        "self_attn.k_proj.weight": (kv_size, hidden),
        "self_attn.k_proj.bias": (kv_size,),
        "self_attn.v_proj.weight": (kv_size, hidden),
        "self_attn.v_proj.bias": (kv_size,),
        "self_attn.o_proj.weight": (hidden, q_size),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }
    tensors = {}
    for leaf in MTP_LAYER_LEAVES:
        if leaf.endswith("layernorm.weight"):
            tensors[leaf] = 1.0 + 0.1 * torch.randn(hidden, generator=generator)
        else:
            tensors[leaf] = 0.1 * torch.randn(shapes[leaf], generator=generator)
    return tensors


def save_tiny_mimo(
    path: Path, num_mtp_layers: int = 1, seed: int = 0, tie_word_embeddings: bool = False
) -> tuple[Qwen2ForCausalLM, dict[str, Tensor]]:
    """Writes the checkpoint to ``path``; returns HF's model of the target and every tensor of
    the checkpoint by name (float32)."""
    config = tiny_mimo_config(tie_word_embeddings)
    torch.manual_seed(seed)
    hf_model = Qwen2ForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name.endswith(("norm.weight", "bias")):  # HF's ones and zeros exercise nothing
                param.add_(0.1 * torch.randn(param.shape, generator=generator))
    tensors = {n: t.detach().clone().contiguous() for n, t in hf_model.state_dict().items()}
    if tie_word_embeddings:
        del tensors["lm_head.weight"]
    for i in range(num_mtp_layers):
        for leaf, tensor in mtp_layer_tensors(config, generator).items():
            tensors[f"model.mtp_layers.{i}.{leaf}"] = tensor
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "model.safetensors")
    config_dict = config.to_dict()
    config_dict.update(
        architectures=["MiMoForCausalLM"],
        num_nextn_predict_layers=num_mtp_layers,
        torch_dtype="float32",
        dtype="float32",
    )
    (path / "config.json").write_text(json.dumps(config_dict, indent=2))
    return hf_model, tensors
