"""Which of FlashInfer's wrapper test cases the parity run covers, and its seeded sample.

Pure Python (``ast``, ``random``): no torch, no flashinfer, so it is tested on any machine.

A case is in scope when

* its ``pos_encoding_mode`` is ``"NONE"`` (tactix computes no rotary embedding in its kernels),
* every head dim it uses (``head_dim``, ``head_dim_qk``, ``head_dim_vo``) is at most 256, and
* its test reaches one of the wrappers the parity run substitutes (a test of FlashInfer's ragged
  wrapper, say, measures nothing of tactix): its source, or that of a module-level function it
  calls, names the wrapper (as ``flashinfer.X``, ``flashinfer.decode.X``, ``X`` or an alias of
  ``from ... import X as Y``).

Parametrised values decide first. Tests that fix these values in their body (``head_dim = 512``),
pass them to a helper (``test_..._nvfp4(head_dim=512, pos_encoding_mode="ROPE_LLAMA")``) or take
them as defaults are read from the source: every literal bound to one of these names in the test,
in the module-level functions it calls (transitively), counts.
"""

from __future__ import annotations

import ast
import random
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

DECODE_FILE = "tests/attention/test_batch_decode_kernels.py"
PREFILL_FILE = "tests/attention/test_batch_prefill_kernels.py"

# Per test file, the names of flashinfer's API the parity run replaces by tactix.compat.flashinfer's,
# wherever the file reaches them (``flashinfer.X``, ``flashinfer.decode.X``, a ``from`` import).
# Only the file's own wrapper is replaced: the decode tests use FlashInfer's prefill wrapper as a
# reference, and that stays FlashInfer's. Optional names are replaced only where tactix provides them.
SUBSTITUTIONS: Mapping[str, tuple[str, ...]] = {
    DECODE_FILE: (
        "BatchDecodeWithPagedKVCacheWrapper",
        "CUDAGraphBatchDecodeWithPagedKVCacheWrapper",
        "fast_decode_plan",
    ),
    PREFILL_FILE: ("BatchPrefillWithPagedKVCacheWrapper",),
}
REQUIRED = frozenset({"BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper"})

HEAD_DIM_NAMES = ("head_dim", "head_dim_qk", "head_dim_vo")
POS_ENCODING = "pos_encoding_mode"
MAX_HEAD_DIM = 256
_WATCHED = frozenset({*HEAD_DIM_NAMES, POS_ENCODING})

OUT_OF_SCOPE_ROPE = 'pos_encoding_mode is not "NONE"'
OUT_OF_SCOPE_HEAD_DIM = f"head_dim > {MAX_HEAD_DIM}"
OUT_OF_SCOPE_NO_WRAPPER = "reaches no substituted wrapper"
NOT_SAMPLED = "not in the seeded sample"


def file_key(path: str) -> str | None:
    """The `SUBSTITUTIONS` key of a test file path (absolute or relative), or None."""
    normal = path.replace("\\", "/")
    for key in SUBSTITUTIONS:
        if normal == key or normal.endswith("/" + key):
            return key
    return None


@dataclass(frozen=True)
class FunctionFacts:
    """What a test function's source says, with the module-level functions it calls."""

    names: frozenset[str]  # every bare name and attribute name it mentions
    literals: Mapping[str, frozenset[object]]  # literal values bound to a watched name


class ModuleFacts:
    """The module-level functions of one test module's source, read once."""

    def __init__(self, source: str) -> None:
        tree = ast.parse(source)
        self._functions = {
            node.name: node for node in tree.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        }
        # `from flashinfer.prefill import BatchPrefillWithPagedKVCacheWrapper as Paged`: Paged counts as the wrapper
        self._aliases = {
            alias.asname: alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
            for alias in node.names
            if alias.asname is not None
        }
        self._memo: dict[str, FunctionFacts] = {}

    def facts(self, function: str) -> FunctionFacts:
        """Facts of ``function`` (empty when the module has no such top-level function)."""
        if function not in self._memo:
            names: set[str] = set()
            literals: dict[str, set[object]] = {}
            self._gather(function, names, literals, set())
            self._memo[function] = FunctionFacts(
                frozenset(names), {key: frozenset(values) for key, values in literals.items()}
            )
        return self._memo[function]

    def _gather(self, function: str, names: set[str], literals: dict[str, set[object]], seen: set[str]) -> None:
        node = self._functions.get(function)
        if node is None or function in seen:
            return
        seen.add(function)
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name):
                names.add(self._aliases.get(sub.id, sub.id))
            elif isinstance(sub, ast.Attribute):
                names.add(sub.attr)
            for name, value in _bindings(sub):
                literals.setdefault(name, set()).add(value)
            if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name):
                self._gather(sub.func.id, names, literals, seen)


def _bindings(node: ast.AST) -> Iterable[tuple[str, object]]:
    """(name, literal) pairs ``node`` binds: ``x = 1``, ``a, x = 2, 3``, ``f(x=1)``, ``def f(x=1)``."""
    pairs: list[tuple[ast.expr | str, ast.expr | None]] = []
    if isinstance(node, ast.Assign):
        for assigned in node.targets:
            if isinstance(assigned, ast.Tuple) and isinstance(node.value, ast.Tuple):
                pairs += zip(assigned.elts, node.value.elts, strict=False)
            else:
                pairs.append((assigned, node.value))
    elif isinstance(node, ast.AnnAssign):
        pairs.append((node.target, node.value))
    elif isinstance(node, ast.keyword) and node.arg is not None:
        pairs.append((node.arg, node.value))
    elif isinstance(node, ast.arguments):
        positional = [*node.posonlyargs, *node.args]
        pairs += zip(
            [arg.arg for arg in positional[len(positional) - len(node.defaults) :]], node.defaults, strict=True
        )
        pairs += zip([arg.arg for arg in node.kwonlyargs], node.kw_defaults, strict=True)
    for target, value in pairs:
        name = target.id if isinstance(target, ast.Name) else target
        if (
            isinstance(name, str)
            and name in _WATCHED
            and isinstance(value, ast.Constant)
            and isinstance(value.value, int | str)
        ):
            yield name, value.value


def _values(name: str, params: Mapping[str, object], facts: FunctionFacts) -> Collection[object]:
    if name in params:
        return (params[name],)
    return facts.literals.get(name, frozenset())


def out_of_scope(params: Mapping[str, object], facts: FunctionFacts, wrappers: Collection[str]) -> str | None:
    """Why a case is out of scope, or None when it is in.

    ``params`` are the case's parametrised values, ``facts`` its test function's, ``wrappers`` the
    wrapper names substituted in its file.
    """
    if any(str(value).upper() != "NONE" for value in _values(POS_ENCODING, params, facts)):
        return OUT_OF_SCOPE_ROPE
    for name in HEAD_DIM_NAMES:
        if any(
            isinstance(v, int) and not isinstance(v, bool) and v > MAX_HEAD_DIM for v in _values(name, params, facts)
        ):
            return OUT_OF_SCOPE_HEAD_DIM
    if not facts.names & set(wrappers):
        return OUT_OF_SCOPE_NO_WRAPPER
    return None


def allocate(sizes: Mapping[str, int], n: int, seed: int) -> dict[str, int]:
    """How many cases of each group (test function) a sample of ``n`` takes.

    Every group gets at least one while ``n`` allows, the rest goes in proportion to the groups'
    sizes (largest remainder; ties by name); with fewer than one per group, ``n`` seeded groups get one.
    """
    groups = sorted(key for key, size in sizes.items() if size > 0)
    total = sum(sizes[key] for key in groups)
    if n >= total:
        return {key: sizes[key] for key in groups}
    if n <= len(groups):
        chosen = random.Random(seed).sample(groups, n)
        return {key: (1 if key in chosen else 0) for key in groups}
    counts = {key: 1 for key in groups}
    spare = n - len(groups)
    room = {key: sizes[key] - 1 for key in groups}
    shares = {key: spare * room[key] / sum(room.values()) for key in groups}
    for key in groups:
        counts[key] += int(shares[key])
    left = n - sum(counts.values())
    by_remainder = sorted(groups, key=lambda key: (-(shares[key] - int(shares[key])), key))
    for key in by_remainder[:left]:
        counts[key] += 1
    return counts


def sample(groups: Mapping[str, Sequence[str]], n: int | None, seed: int) -> set[str]:
    """The case ids a seeded sample of ``n`` keeps (all of them when ``n`` is None).

    ``groups`` maps a test function to its in-scope case ids. The draw depends only on the ids,
    ``n`` and ``seed``, not on the collection order, so a ``--reference`` run draws the same cases.
    """
    if n is None:
        return {case for cases in groups.values() for case in cases}
    counts = allocate({key: len(cases) for key, cases in groups.items()}, n, seed)
    kept: set[str] = set()
    for key in sorted(counts):
        rng = random.Random(f"{seed}:{key}")
        kept.update(rng.sample(sorted(groups[key]), counts[key]))
    return kept
