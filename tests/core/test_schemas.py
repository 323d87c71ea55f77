"""Problems, tactics and the public surface: canonical forms, stable hashes, complete keys."""

from __future__ import annotations

import subprocess
import sys
import types
from typing import Any

import pytest

import tactix
from tactix.ops import DecodeProblem, GemmProblem, PrefillProblem, RaggedPrefillProblem
from tactix.problems import make_problem, problem_from_key
from tactix.tactics import SCHEMA_VERSION, Tactic, parse_tactic

PREFILL: dict[str, Any] = dict(
    device_type="cuda",
    num_qo_heads=32,
    num_kv_heads=8,
    head_dim_qk=128,
    head_dim_vo=128,
    page_size=16,
    kv_layout="HND",
    q_dtype="bfloat16",
    kv_dtype="bfloat16",
    out_dtype="bfloat16",
    sm_scale=0.088,
    window_left=-1,
    logits_soft_cap=0.0,
    return_lse=False,
    batch_size=8,
    max_kv_len=2048,
    causal=True,
    num_qo_tokens=16384,
    max_qo_len=2048,
)
RAGGED: dict[str, Any] = {
    **{k: v for k, v in PREFILL.items() if k not in ("page_size", "kv_layout")},
    "num_kv_tokens": 20000,
}
GEMM: dict[str, Any] = dict(
    device_type="cuda",
    m=64,
    n=4096,
    k=4096,
    batch=1,
    batched=False,
    a_dtype="bfloat16",
    b_dtype="bfloat16",
    out_dtype="bfloat16",
    a_k_major=True,
    b_k_major=True,
    scale_mode="none",
    bias_dtype=None,
)
# a different valid value for every field, to show each one reaches the key
OTHER: dict[str, Any] = dict(
    device_type="cpu",
    num_qo_heads=16,
    num_kv_heads=4,
    head_dim_qk=64,
    head_dim_vo=64,
    page_size=32,
    kv_layout="NHD",
    q_dtype="float16",
    kv_dtype="float16",
    out_dtype="float32",
    sm_scale=0.125,
    window_left=512,
    logits_soft_cap=30.0,
    return_lse=True,
    causal=False,
    n=4097,
    k=2048,
    batch=4,
    batched=True,
    a_dtype="float16",
    b_dtype="float16",
    a_k_major=False,
    b_k_major=False,
    scale_mode="per_tensor",
    bias_dtype="bfloat16",
)


def test_tactic_json_is_canonical_and_hash_ignores_insertion_order() -> None:
    a = Tactic(backend="cudnn", kernel="sdpa", params={"engine": 8, "knobs": {"b": 1, "a": [2, 3]}})
    b = Tactic(backend="cudnn", kernel="sdpa", params={"knobs": {"a": [2, 3], "b": 1}, "engine": 8})
    assert a == b and hash(a) == hash(b) and a.digest() == b.digest()
    assert a.to_json() == b.to_json()
    assert " " not in a.to_json() and a.to_json().index('"backend"') < a.to_json().index('"kernel"')
    assert parse_tactic(a.to_json()) == a
    assert a != Tactic(backend="cudnn", kernel="sdpa", params={"engine": 9, "knobs": {"b": 1, "a": [2, 3]}})


def test_tactic_digest_is_the_same_in_a_fresh_process() -> None:
    tactic = Tactic(backend="torch", kernel="sdpa", params={"impl": "efficient", "x": 1.5})
    code = f"from tactix.tactics import Tactic\nprint(Tactic.model_validate_json({tactic.to_json()!r}).digest())\n"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == tactic.digest()


@pytest.mark.parametrize("value", [3, "3", True, 2.5, [1], None])
def test_bare_plan_indices_and_other_non_objects_are_rejected(value: object) -> None:
    with pytest.raises(tactix.TacticError, match="not a valid tactic"):
        parse_tactic(value)  # type: ignore[arg-type]
    if isinstance(value, int) and not isinstance(value, bool):
        with pytest.raises(tactix.TacticError, match="bare plan indices"):
            parse_tactic(value)  # type: ignore[arg-type]


def _problems() -> list[Any]:
    """Problems across devices, layouts, head dims and GEMM dtypes, for enumerating tactic spaces."""
    decode = {k: v for k, v in PREFILL.items() if k not in ("causal", "num_qo_tokens", "max_qo_len")}
    fp8 = {"a_dtype": "float8_e4m3fn", "b_dtype": "float8_e4m3fn", "scale_mode": "per_tensor"}
    problems: list[Any] = []
    for device in ("cpu", "cuda"):
        for layout in ("HND", "NHD"):
            for d in (64, 128, 256):
                dims = {"device_type": device, "kv_layout": layout, "head_dim_qk": d, "head_dim_vo": d}
                problems += [PrefillProblem(**dict(PREFILL, **dims)), DecodeProblem(**dict(decode, **dims))]
        for m in (1, 64, 4096):
            problems += [GemmProblem(**dict(GEMM, device_type=device, m=m)),
                         GemmProblem(**dict(GEMM, device_type=device, m=m, **fp8))]  # fmt: skip
    return problems


def test_every_enumerable_tactic_reads_back_from_its_printed_form() -> None:
    """What wrappers, bench tables and warnings print can be passed back as ``tactic=``."""
    counted: dict[str, int] = {}
    with_params = 0
    problems = _problems()
    for backend in tactix.get_registry().active():
        for problem in problems:
            if problem.op not in backend.spec.ops:
                continue
            for tactic in backend.tactics(problem):
                shown = str(tactic)
                assert parse_tactic(shown) == tactic, f"{backend.name}: {shown!r} reads back as another tactic"
                counted[backend.name] = counted.get(backend.name, 0) + 1
                with_params += bool(tactic.params)
    assert counted.get("torch", 0) > 0 and with_params > 0, counted  # the spaces were really enumerated
    print(f"tactics read back per backend: {counted}")


@pytest.mark.parametrize(
    "params",
    [
        {"impl": "efficient"},
        {"engine": 8, "knobs": {"KERNEL_CFG": 35}},  # cudnn's engine and knobs
        {"multi_block": "auto", "pdl": True},  # trtllm's XQA variant
        {"digits": "2", "word": "true", "nothing": "null", "nan": "NaN", "empty": ""},  # strings, not literals
        {"spaced": "a b,c)d=e", "quoted": 'say "x"', "accent": "h\u00e9"},
        {"int": 2, "float": 2.0, "negative": -3, "big": 1e300, "none": None, "not_a_number": float("nan")},
        {"list": [1, "two", {"three": 3.5}], "object": {"b": [], "a": {}}},
        {"two words": 1, "1st": 2, "\u00e9t\u00e9": 3, "with=sign": 4},
    ],
    ids=["word", "nested-object", "bool", "literal-like-strings", "punctuation", "numbers", "containers", "odd-names"],
)
def test_printed_form_keeps_every_param_type(params: dict[str, Any]) -> None:
    tactic = Tactic(backend="some_backend", kernel="kernel_v2", params=params)
    shown = str(tactic)
    back = parse_tactic(shown)
    assert back == tactic and back.to_json() == tactic.to_json(), f"{shown!r} read back as {back.to_json()}"
    assert parse_tactic(f"  {shown} ") == tactic  # pasted with surrounding blanks


def test_printed_forms_in_recorded_tables_read_back() -> None:
    """The forms recorded in benchmarks/results (and shown in the docs) name these tactics."""
    assert parse_tactic("torch:explicit") == Tactic(backend="torch", kernel="explicit")
    assert parse_tactic("torch:sdpa(impl=efficient)") == Tactic(backend="torch", kernel="sdpa",
                                                                params={"impl": "efficient"})  # fmt: skip
    assert parse_tactic("cuda_native:decode(kv_chunk=0,stages=2,tile=64,warps=4)") == Tactic(
        backend="cuda_native", kernel="decode", params={"kv_chunk": 0, "stages": 2, "tile": 64, "warps": 4}
    )
    assert parse_tactic('cudnn:sdpa(engine=8,knobs={"KERNEL_CFG":35})') == Tactic(
        backend="cudnn", kernel="sdpa", params={"engine": 8, "knobs": {"KERNEL_CFG": 35}}
    )
    assert parse_tactic("torch:sdpa( impl = math )") == Tactic(backend="torch", kernel="sdpa", params={"impl": "math"})


@pytest.mark.parametrize(
    "fields",
    [{"backend": "to:rch", "kernel": "x"}, {"backend": "Torch", "kernel": "x"}, {"backend": "torch", "kernel": "a(b"},
     {"backend": "torch", "kernel": "a b"}, {"backend": "torch", "kernel": ""}],
)  # fmt: skip
def test_names_that_would_make_the_printed_form_ambiguous_are_refused(fields: dict[str, str]) -> None:
    with pytest.raises(tactix.TacticError, match="not a valid tactic"):
        parse_tactic(fields)


def test_foreign_schema_version_is_rejected() -> None:
    with pytest.raises(tactix.TacticError, match="schema_version"):
        parse_tactic({"schema_version": SCHEMA_VERSION + 1, "backend": "torch", "kernel": "explicit"})


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 16, 17, 1000, 1024, 1025, 65537])
def test_bucket_is_the_next_power_of_two(n: int) -> None:
    b = tactix.bucket_size(n)
    assert b >= n and (b == 0 or b & (b - 1) == 0) and (n == 0 or b < 2 * n)


@pytest.mark.parametrize(
    ("cls", "base"), [(PrefillProblem, PREFILL), (RaggedPrefillProblem, RAGGED), (GemmProblem, GEMM)]
)
def test_every_static_field_reaches_the_key(cls: type, base: dict[str, Any]) -> None:
    problem = cls(**base)
    for name in base:
        if name in cls.dynamic:
            continue
        changed = dict(base, **{name: OTHER[name]})
        if name == "scale_mode":  # scales come with fp8 operands
            changed.update(a_dtype="float8_e4m3fn", b_dtype="float8_e4m3fn")
        assert cls(**changed).key_hash() != problem.key_hash(), f"{name} does not change the key"
        assert cls(**changed).bucket_key() != problem.bucket_key(), f"{name} does not change the bucket key"


@pytest.mark.parametrize(
    ("cls", "base"), [(PrefillProblem, PREFILL), (RaggedPrefillProblem, RAGGED), (GemmProblem, GEMM)]
)
def test_dynamic_sizes_share_a_key_within_their_bucket_only(cls: type, base: dict[str, Any]) -> None:
    problem = cls(**base)
    for name in cls.dynamic:
        value = base[name]
        same = dict(base, **{name: value // 2 + 1}) if value > 2 else None
        if same is not None and tactix.bucket_size(same[name]) == tactix.bucket_size(value):
            assert cls(**same).key_hash() == problem.key_hash(), name
            assert cls(**same).bucket_key() == problem.bucket_key(), name
        bigger = dict(base, **{name: value * 2 + 1})
        assert cls(**bigger).key_hash() != problem.key_hash(), name
        assert cls(**bigger).bucket_key() != problem.bucket_key(), name


def test_problem_key_round_trips() -> None:
    problem = PrefillProblem(**PREFILL)
    rebuilt = problem_from_key(problem.key())
    assert rebuilt == problem.bucketed() and rebuilt.key_hash() == problem.key_hash()
    decode = DecodeProblem(**{k: v for k, v in PREFILL.items() if k not in ("causal", "num_qo_tokens", "max_qo_len")})
    assert decode.key_hash() != problem.key_hash()  # the op is part of the key
    ragged = RaggedPrefillProblem(**RAGGED)
    assert problem_from_key(ragged.key()) == ragged.bucketed() and "page_size" not in ragged.key()


def test_invalid_problem_names_the_field() -> None:
    with pytest.raises(tactix.InvalidArgumentError, match="num_qo_heads"):
        make_problem("prefill", **dict(PREFILL, num_qo_heads=30))
    with pytest.raises(tactix.InvalidArgumentError, match="page_size"):
        make_problem("prefill", **dict(PREFILL, page_size=0))


def test_problem_labels_read_like_test_ids() -> None:
    assert str(PrefillProblem(**PREFILL)) == "prefill[bf16-h32/8-d128-p16-HND-causal]"
    assert str(GemmProblem(**GEMM)) == "gemm[bf16->bf16-m64n4096k4096-A-kB-k]"
    assert str(RaggedPrefillProblem(**RAGGED)) == "ragged_prefill[bf16-h32/8-d128-causal]"


def test_all_lists_exactly_the_public_names() -> None:
    public = {
        name
        for name, value in vars(tactix).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert set(tactix.__all__) == public | {"__version__", "autotune"}  # autotune: a callable package
    assert len(tactix.__all__) == len(set(tactix.__all__))
