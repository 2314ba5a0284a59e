"""Renaming on-disk keys once per template, not once per key: transformers' share of mapping a checkpoint.

Keys equal but for their layer and expert numbers (`model.layers.{L}.mlp.experts.{E}.gate_proj.weight`) form a
template. Where renaming treats those numbers as opaque text (`indices_are_opaque`), transformers renames one member
of each template and the rest follow by substituting the numbers (`rename_by_template`), checked on one more member
per number that varies; the result is sorted as transformers sorts it (`natural_sort`). So transformers' share of
the work does not grow with the number of layers. `reshard.read._experts` renames every key where this does not hold.
"""

from __future__ import annotations

import re
from collections import defaultdict

# A whole dotted component made of digits (a layer or expert index); `split` keeps it as an odd-numbered part.
_INDEX = re.compile(r"(?<![^.])(\d+)(?![^.])")
# Regex constructs that could tell one index from another (a digit class, a length, a literal number): a mapping
# using one is renamed key by key.
_INDEX_SPECIFIC = re.compile(r"\\[dDwW]|\[|\{|(?<![A-Za-z0-9_\\])\d")


def indices_are_opaque(mapping, prefix: str, meta_state) -> bool:
    """Whether renaming treats index components as opaque text, so a template's rule holds for all its keys.

    Holds when every transform renames with the stock regex machinery (no subclass that computes indices, like
    Inkling 2's offset rename), none of its patterns can tell one index from another (`_INDEX_SPECIFIC`), and the
    base-model prefix fix-up cannot depend on an index. transformers strips `prefix` and the character after it
    when the rest is a state-dict name, else adds `prefix.` when that is one; the outcome can only differ between
    two keys of a template if some state-dict name is also one with the prefix stripped once or twice.
    """
    from transformers.core_model_loading import WeightTransform

    for transform in mapping:
        if type(transform).rename_source_key is not WeightTransform.rename_source_key:
            return False
        if any(_INDEX_SPECIFIC.search(p) for p in (*transform.source_patterns, *transform.target_patterns)):
            return False
        if any(ch.isdigit() for ch in f"{transform.scope_prefix or ''}{transform.base_model_prefix or ''}"):
            return False
    if any(ch.isdigit() for ch in prefix or ""):
        return False

    def strip(name: str) -> str | None:
        return name[len(prefix) + 1:] if prefix and name.startswith(prefix) and len(name) > len(prefix) else None

    for name in meta_state:
        once = strip(name)
        if once is not None and (once in meta_state or strip(once) in meta_state):
            return False
    return True


def rename_by_template(keys, transformers_rename, rename, meta_state):
    """`rename` of every key (in `keys`' order), calling transformers once or twice per template, not once per key.

    Keys equal but for their index components (`model.layers.{L}.mlp.experts.{E}.gate_proj.weight`) form a template.
    `transformers_rename` is learnt on a member whose indices are pairwise distinct: each index of its target must
    be one of them, which says where each target index comes from. The rule is checked with `transformers_rename` on
    one more member per index position that varies, and used only where its target is a state-dict name; any other
    key goes through `rename`. Only valid when `indices_are_opaque`.

    Returns:
        key -> (target, pattern), and key -> its template and indices (for `natural_sort`).
    """
    split = {}
    templates: dict[tuple[str, ...], list[tuple[str, list[str]]]] = defaultdict(list)
    for key in keys:
        parts = _INDEX.split(key)
        split[key] = template, indices = tuple(parts[0::2]), parts[1::2]
        templates[template].append((key, indices))
    rules = {t: _learn_rule(members, transformers_rename) for t, members in templates.items() if len(members) > 1}
    out = {}
    for key, (template, indices) in split.items():
        rule = rules.get(template)
        if rule is not None:
            texts, positions, pattern = rule
            target = _fill(texts, [indices[j] for j in positions])
            if target in meta_state:
                out[key] = (target, pattern)
                continue
        out[key] = rename(key)
    return out, split


def _fill(texts, indices) -> str:
    return "".join(t + i for t, i in zip(texts, indices)) + texts[-1]


def _learn_rule(members, transformers_rename):
    """(target texts, source position of each target index, pattern) for a template, or None when not learnt."""
    first = next(((k, i) for k, i in members if len(set(i)) == len(i)), None)
    if first is None:
        return None
    key, indices = first
    target, pattern = transformers_rename(key)
    parts = _INDEX.split(target)
    try:
        positions = [indices.index(i) for i in parts[1::2]]
    except ValueError:  # an index the renaming made up or changed
        return None
    texts = parts[0::2]
    for position in range(len(indices)):
        other = next(((k, i) for k, i in members if i[position] != indices[position]), None)
        if other is not None and \
                transformers_rename(other[0]) != (_fill(texts, [other[1][j] for j in positions]), pattern):
            return None
    return texts, positions, pattern


def natural_sort(keys: list[str], split, dot_natural_key) -> None:
    """Sort `keys` into transformers' natural key order. Keys of one template differ only in their indices, which
    that order compares as integers, left to right."""
    if len({split[k][0] for k in keys}) > 1:
        keys.sort(key=dot_natural_key)
    else:
        keys.sort(key=lambda k: [int(i) for i in split[k][1]])
