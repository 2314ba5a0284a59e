"""Bound the config before a model is built from it: the values that size the model, checked against the headers.

Building a model on the meta device costs no tensor memory, but every layer and every unfused expert is a Python
module: a `config.json` saying `num_hidden_layers: 1000000000` beside the weights of two layers would build until
the machine runs out of memory. Every value that makes modules or sizes a weight is checked here first, against what
the headers say (pure, torch-free, over header metadata only), and refused with the value and what the weights hold.

The bounds are ones no real checkpoint can exceed: a model's layers each hold at least one tensor and carry their
index in the key (`model.layers.N.`, `h.N.`, `blocks.N.`), so the config cannot name more layers than the keys do;
an expert count, a width or a vocabulary is a dimension of some tensor (the embedding is `[vocab, hidden]`, fused
experts are `[experts, ...]`) or, for experts stored one by one, at most the number of tensors.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ..errors import CheckpointError

# the values that build modules (layers, experts) or size weights (widths, vocabulary), under the names model types
# give them; nested configs (`text_config`, `vision_config`, ...) are checked the same way
LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "num_decoder_layers", "depth")
SIZE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "n_shared_experts",
             "num_shared_experts", "num_experts_per_tok", "hidden_size", "d_model", "n_embd", "intermediate_size",
             "moe_intermediate_size", "shared_expert_intermediate_size", "ffn_hidden_size", "vocab_size",
             "num_attention_heads", "num_key_value_heads", "head_dim")
_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)(?:\.|$)")


def check_config_bounds(config: dict, shapes: Iterable[tuple[str, tuple[int, ...]]], *, where: str,
                        rank_files: int = 0) -> None:
    """Refuse a config whose model could not be built from these tensors, before anything is built.

    Args:
        config: the parsed `config.json`.
        shapes: every tensor's key and (global) shape, from the headers.
        where: the source, for the message.
        rank_files: for a folder of rank files, how many there are; the shapes are then the far corners of their
            chunks, short of the global extent when a rank file is missing, and the size bound is widened by
            `rank_files + 1` so that the missing file is what the caller names, not the config.

    Raises:
        CheckpointError: a sizing value names more layers than the keys hold, or is larger than every dimension of
            every tensor and than the number of tensors. (Other wrong values, a string or a negative, build nothing
            large: transformers' config class refuses them, or the layout does not fit the headers.)
    """
    tensors, largest, layers = 0, 0, 0
    for name, shape in shapes:
        tensors += 1
        largest = max(largest, *shape, 0)
        for match in _LAYER_INDEX.finditer(name):
            layers = max(layers, int(match.group(1)) + 1)
    for path, key, value in _sizing_values(config):
        if key in LAYER_KEYS and layers and value > layers:
            raise _refused(where, path, value, f"names more layers than the weights hold ({layers}: keys with layer "
                                               f"indices 0-{layers - 1})")
        bound = max(largest, tensors) * (rank_files + 1)
        if value > bound:
            raise _refused(where, path, value, f"is larger than any dimension of the weights ({largest}) and than "
                                               f"their number of tensors ({tensors}): no model of that size is in "
                                               "these files")


def _sizing_values(config: dict, prefix: str = ""):
    """(dotted path, key, value) for every sizing key in `config` and in its nested configs, nothing else."""
    for key, value in config.items():
        if isinstance(value, dict) and (key.endswith("_config") or key == "config"):
            yield from _sizing_values(value, f"{prefix}{key}.")
        elif key in LAYER_KEYS or key in SIZE_KEYS:
            for number in value if isinstance(value, list) else [value]:  # a per-layer list: each entry
                # whole numbers only: a float or a string is the config class's to refuse, with its type
                if isinstance(number, int) and not isinstance(number, bool):
                    yield f"{prefix}{key}", key, number


def _refused(where: str, path: str, value, why: str) -> CheckpointError:
    shown = f"{value:,}" if isinstance(value, int) else repr(value)
    return CheckpointError(f"{where}: config.json's {path} is {shown}, which {why}. Fix {path} in config.json (the "
                           "model's own value, as its authors published it). Nothing was built, read or changed.",
                           path="config.json")
