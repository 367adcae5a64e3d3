"""DeepSeek's released DSpark drafters, read as DeepSpec's `save_pretrained` writes them.

config.json is the target's Qwen3 config with `architectures: ["Qwen3DSparkModel"]` and the
drafter's fields: `num_hidden_layers` (drafter layers), `num_target_layers`, `target_layer_ids`,
`block_size` (K), `mask_token_id`, `markov_rank` (0: a DFlash drafter, no Markov head),
`markov_head_type`, `enable_confidence_head`, `confidence_head_with_markov`. model.safetensors
holds unprefixed names; each maps onto DSparkDrafter's network, which computes the same thing:

  fc [H, m H], hidden_norm            -> fc, context_norm: context features -> keys/values
  layers.i.self_attn.{q,k,v}_proj     -> layers.i.self_attn.qkv_proj (stacked [q; k; v])
  layers.i.self_attn.{q,k}_norm       -> the same (context keys are k-normed too)
  layers.i.mlp.{gate,up}_proj         -> layers.i.mlp.gate_up_proj; the rest by name
  markov_head.markov_w{1,2} [V, r]    -> markov_in (W1, an embedding), markov_out (W2)
  confidence_head.proj [1, H + r]     -> confidence: sees [h ; W1[prev]]
  embed_tokens, lm_head               -> frozen copies of the target's: compared with it (the
                                         identity check; there is no weights hash), and row
                                         mask_token_id of embed_tokens is the MASK embedding

Tap layers: DeepSpec reads hidden_states[i + 1] of transformers' output for target layer i,
the residual stream after decoder layer i, which is what the target's `hidden_layers` give,
except for the last layer, whose transformers hidden state is taken after the final norm; a
tap there (and -1, the embeddings) is refused, as are head types other than "vanilla".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dspark.models.drafter_config import DrafterConfig, DrafterMismatchError, TargetIdentity

if TYPE_CHECKING:
    from dspark.models.llama import LlamaForCausalLM

DEEPSPEC_ARCHITECTURE = "Qwen3DSparkModel"
TARGET_ARCHITECTURE = "Qwen3ForCausalLM"
# the drafter's config fields that must equal the target's (its layers are the target's shape)
SHARED_FIELDS = {
    "hidden_size": "hidden_size",
    "vocab_size": "vocab_size",
    "intermediate_size": "intermediate_size",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "head_dim": "head_dim",
}


class DeepSpecFormatError(ValueError):
    """A Qwen3DSparkModel checkpoint this engine cannot serve as it is described."""


def is_deepspec(hf: dict[str, Any]) -> bool:
    return DEEPSPEC_ARCHITECTURE in (hf.get("architectures") or [])


def deepspec_dims(hf: dict[str, Any]) -> tuple[int, int]:
    """(drafter layers, draft length K) of a DeepSpec config."""
    return int(hf["num_hidden_layers"]), int(hf["block_size"])


def deepspec_drafter_config(
    hf: dict[str, Any], target: LlamaForCausalLM, identity: TargetIdentity
) -> DrafterConfig:
    """The DrafterConfig a DeepSpec config.json describes, checked against the live target
    (`identity` is the target's own: the weights are compared in deepspec_state_dict)."""

    tc = target.checkpoint_config  # (the whole model's, under tensor parallelism too)
    if tc.architecture != TARGET_ARCHITECTURE:
        raise DeepSpecFormatError(
            f"a {DEEPSPEC_ARCHITECTURE} drafter drafts for {TARGET_ARCHITECTURE} targets, "
            f"not {tc.architecture}"
        )
    for field, ours in SHARED_FIELDS.items():
        want = hf.get(field, tc.head_dim) if field == "head_dim" else hf.get(field)
        if want != getattr(tc, ours):
            raise DeepSpecFormatError(
                f"drafter {field} is {want!r} but the target's is {getattr(tc, ours)!r}: "
                "it was trained for another target"
            )
    if int(hf.get("num_target_layers", -1)) != tc.num_layers:
        raise DeepSpecFormatError(
            f"drafter num_target_layers is {hf.get('num_target_layers')!r} but the target has "
            f"{tc.num_layers} layers"
        )
    taps = tuple(int(i) for i in hf["target_layer_ids"])
    rank = int(hf.get("markov_rank", 0))
    _check_taps(taps, tc.num_layers)
    _check_heads(hf, rank)
    return DrafterConfig(
        identity,
        draft_len=int(hf["block_size"]),
        target_layers=taps,
        num_layers=int(hf["num_hidden_layers"]),
        markov_rank=rank,
        use_confidence=bool(hf.get("enable_confidence_head", False)),
        mask_token_id=int(hf["mask_token_id"]),
    )


def _check_taps(taps: tuple[int, ...], num_layers: int) -> None:
    if not taps or any(not 0 <= i < num_layers - 1 for i in taps):
        raise DeepSpecFormatError(
            f"target_layer_ids {list(taps)}: allowed 0..{num_layers - 2} (-1, the embeddings, "
            "and the last layer, which transformers reports after the final norm, are not "
            "taps this engine reads)"
        )
    if list(taps) != sorted(set(taps)):
        raise DeepSpecFormatError(f"target_layer_ids {list(taps)} must be strictly increasing")


def _check_heads(hf: dict[str, Any], rank: int) -> None:
    if rank < 0:
        raise DeepSpecFormatError(f"markov_rank {rank}: allowed 0 (DFlash) or more")
    head_type = hf.get("markov_head_type", "vanilla")
    if rank > 0 and head_type != "vanilla":
        raise DeepSpecFormatError(
            f"markov_head_type {head_type!r} is not supported; allowed: 'vanilla'"
        )
    with_markov = bool(hf.get("confidence_head_with_markov", rank > 0))
    if hf.get("enable_confidence_head") and with_markov != (rank > 0):
        raise DeepSpecFormatError(
            f"confidence_head_with_markov={with_markov} with markov_rank {rank}: the confidence "
            "head sees the Markov embedding exactly when there is a Markov head"
        )


def deepspec_state_dict(
    tensors: dict[str, torch.Tensor], config: DrafterConfig, target: LlamaForCausalLM
) -> dict[str, torch.Tensor]:
    """DeepSpec's tensor names -> DSparkDrafter's state dict, after checking that its frozen
    embedding and LM head are the target's (under tensor parallelism, each rank the rows of
    its vocabulary shard: together the whole)."""
    out = dict(tensors)
    embed, lm_head = out.pop("embed_tokens.weight"), out.pop("lm_head.weight", None)
    _check_same("embed_tokens", embed, target.embed_tokens.weight, target)
    if lm_head is not None:
        _check_same("lm_head", lm_head, target.lm_head.weight, target)
    out["mask_embedding"] = embed[config.mask_token_id].clone()
    out["context_norm.weight"] = out.pop("hidden_norm.weight")
    for i in range(config.num_layers):
        p = f"layers.{i}."
        qkv = [out.pop(f"{p}self_attn.{n}_proj.weight") for n in "qkv"]
        out[f"{p}self_attn.qkv_proj.weight"] = torch.cat(qkv)
        gate_up = [out.pop(f"{p}mlp.{n}_proj.weight") for n in ("gate", "up")]
        out[f"{p}mlp.gate_up_proj.weight"] = torch.cat(gate_up)
    renames = {
        "markov_head.markov_w1.weight": "markov_in.weight",
        "markov_head.markov_w2.weight": "markov_out.weight",
        "confidence_head.proj.weight": "confidence.weight",
        "confidence_head.proj.bias": "confidence.bias",
    }
    for theirs, ours in renames.items():
        if theirs in out:
            out[ours] = out.pop(theirs)
    return out


def _check_same(
    name: str, stored: torch.Tensor, live: torch.Tensor, target: LlamaForCausalLM
) -> None:
    """stored [V, d] against the target's live rows: all of them, or with tensor parallelism
    this rank's shard (rows rank * S .. of S a rank; the last rank's past V are padding).

      V 10, 4 ranks: S 3; rank 3 holds rows 9..11 and compares row 9 only
    """
    full = (target.checkpoint_config.vocab_size, target.checkpoint_config.hidden_size)
    whole, mine, rows = tuple(stored.shape), stored, live
    if target.tp is not None and whole == full:
        start = target.tp.rank * live.shape[0]
        count = max(0, min(live.shape[0], full[0] - start))
        mine, rows = stored[start : start + count], live[:count]
    if mine.shape != rows.shape or not torch.equal(mine.to(rows), rows):
        target_shape = full if target.tp is not None else tuple(live.shape)
        raise DrafterMismatchError(
            f"the drafter's frozen {name} {whole} differs from the loaded target's "
            f"{target_shape}: it was trained for another target"
        )
