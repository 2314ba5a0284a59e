"""The converter ops transformers 5.24 added, as `reshard.read._converter_ops.compose_pieces` takes or refuses them.

reshard matches ops by class name, so these tests build converters with stand-in ops of the same names: they run on
every tested transformers (on 5.23 the classes do not exist), and the breadth matrix runs the real ones on 5.24.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from reshard.errors import ArchitectureError, ReshardError
from reshard.plan import Piece
from reshard.read._converter_ops import compose_pieces


def _op(name: str, **fields):
    return type(name, (), fields)()


@dataclass
class _Converter:
    source_patterns: list
    target_patterns: list
    operations: list


def _index(**shapes):
    return SimpleNamespace(source="<src>", tensors={k: SimpleNamespace(shape=s, file="x.safetensors")
                                                    for k, s in shapes.items()})


def _compose_one(target_shape, source_shape, op, sources=("lm_head.weight",), targets=("lm_head.weight",)):
    converter = _Converter(list(sources), list(targets), [op])
    index = _index(**{sources[0]: source_shape})
    groups = {sources[0]: [sources[0]]}
    by_pattern = {p: converter for p in sources}
    return compose_pieces("lm_head.weight", target_shape, groups, by_pattern, index, "inkling2_text")


def test_unpad_vocab_is_the_source_itself_when_it_stores_exactly_the_models_rows():
    pieces = _compose_one((512, 64), (512, 64), _op("Inkling2UnpadVocab"))
    assert pieces == [Piece("lm_head.weight", (0, 0), None)]


def test_a_padded_unembedding_is_refused_with_both_shapes():
    with pytest.raises(ArchitectureError, match="padded") as e:
        _compose_one((512, 64), (520, 64), _op("Inkling2UnpadVocab"))
    assert isinstance(e.value, ReshardError)
    message = str(e.value)
    assert message.startswith("inkling2_text: lm_head.weight is stored padded ([520, 64] on disk, [512, 64] in memory")
    assert message.endswith("Nothing was written.")


def test_split_is_refused_naming_the_fused_source_and_its_parts():
    with pytest.raises(ArchitectureError, match="Split of") as e:
        _compose_one((64, 64), (128, 64), _op("Split", dim=0), sources=("query_key_value",),
                     targets=("q_proj", "k_proj", "v_proj"))
    message = str(e.value)
    assert "Split of ['query_key_value'] into ['q_proj', 'k_proj', 'v_proj']" in message
    assert "from whole on-disk tensors" in message and message.endswith("Nothing was written.")


def test_inkling2_loop_dequantize_experts_is_refused_by_name():
    with pytest.raises(ArchitectureError, match=r"built with \['Inkling2LoopDequantizeExperts'\] \(transformers "
                                                r"dequantizes the NVFP4/MXFP8 experts"):
        _compose_one((4, 8, 16), (4, 8, 16), _op("Inkling2LoopDequantizeExperts"))


def test_an_unknown_op_keeps_the_generic_refusal():
    with pytest.raises(ArchitectureError, match=r"built with \['Interleave'\]; reshard composes only MergeModulelist"):
        _compose_one((4, 8, 16), (4, 8, 16), _op("Interleave", dim=1))
