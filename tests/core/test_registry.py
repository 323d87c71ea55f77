"""Backend discovery through real entry points: failures isolated, allow/deny lists, duplicates."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tactix
from tactix.registry import get_registry
from tests.plugin_fixtures import (
    BROKEN_IMPORT,
    MISSPELT_HOOK,
    RAISING_REGISTRATION,
    WRONG_NAME,
    delegating_plugin,
    plugins_on_path,
    write_distribution,
)


def _decode_runs_on(backend: str = "auto") -> str:
    wrapper = tactix.PagedDecode("NHD", device="cpu", backend=backend)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    wrapper.plan(i32(0, 1), i32(0), i32(3), 4, 2, 16, 4, q_data_type=torch.float32)
    cache = torch.randn(1, 4, 2, 16), torch.randn(1, 4, 2, 16)
    out = wrapper.run(torch.randn(1, 4, 16), cache)
    assert isinstance(out, torch.Tensor) and bool(torch.isfinite(out).all())
    return wrapper.backend


@pytest.fixture
def broken_plugins(tmp_path: Path) -> Path:
    write_distribution(
        tmp_path, "tactix-broken", "0.3.1", {"broken": "tx_broken_mod"}, {"tx_broken_mod": BROKEN_IMPORT}
    )
    write_distribution(
        tmp_path, "tactix-raiser", "1.0", {"raiser": "tx_raiser_mod"}, {"tx_raiser_mod": RAISING_REGISTRATION}
    )
    write_distribution(
        tmp_path,
        "tactix-wrongname",
        "1.0",
        {"wrongname": "tx_wrongname_mod"},
        {"tx_wrongname_mod": WRONG_NAME},
    )
    write_distribution(
        tmp_path,
        "tactix-misspelt",
        "1.0",
        {"misspelt": "tx_misspelt_mod"},
        {"tx_misspelt_mod": MISSPELT_HOOK},
    )
    return tmp_path


def test_torch_backend_is_active_by_default() -> None:
    record = {r.name: r for r in get_registry().records()}["torch"]
    assert record.status == "active"
    assert record.distribution == "tactix"
    assert record.spec is not None and set(record.spec.ops) == {
        "prefill",
        "decode",
        "ragged_prefill",
        "gemm",
        "merge_states",
    }


def test_broken_plugins_are_recorded_and_skipped(broken_plugins: Path) -> None:
    with plugins_on_path(broken_plugins):
        records = {r.name: r for r in get_registry().records()}
        broken = records["broken"]
        assert broken.status == "failed"
        assert broken.distribution == "tactix-broken" and broken.distribution_version == "0.3.1"
        assert "ImportError" in (broken.error or "") and "libmissing.so.1" in (broken.error or "")
        assert records["raiser"].status == "failed"
        assert "registration exploded" in (records["raiser"].error or "")
        assert records["wrongname"].status == "failed"
        assert "someone_else" in (records["wrongname"].error or "")
        assert records["misspelt"].status == "failed"
        assert "tactix_plan_prefil" in (records["misspelt"].error or "")
        assert records["torch"].status == "active"
        # everything else keeps working, and asking for a failed backend says why
        assert _decode_runs_on() == "torch"
        with pytest.raises(tactix.BackendUnavailableError, match="libmissing"):
            tactix.PagedDecode(backend="broken")


def test_cli_lists_failed_plugin_with_its_error(broken_plugins: Path) -> None:
    path = os.pathsep.join(p for p in (str(broken_plugins), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path)
    plain = subprocess.run(
        [sys.executable, "-m", "tactix", "backends"], env=env, capture_output=True, text=True, check=True
    )
    assert "torch" in plain.stdout and "active" in plain.stdout
    assert "broken: failed to import: ImportError: libmissing.so.1" in plain.stdout
    as_json = subprocess.run(
        [sys.executable, "-m", "tactix", "backends", "--json"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    rows = {r["name"]: r for r in json.loads(as_json.stdout)}
    assert rows["broken"]["status"] == "failed" and rows["broken"]["runs_here"] is False
    assert rows["torch"]["status"] == "active" and rows["torch"]["runs_here"] is True
    assert rows["torch"]["ops"] == ["prefill", "decode", "ragged_prefill", "gemm", "merge_states"]


def test_duplicate_names_fail_naming_both_distributions(tmp_path: Path) -> None:
    source = delegating_plugin("twin", preference=0)
    write_distribution(tmp_path, "tactix-twin-a", "1.0", {"twin": "tx_twin_a"}, {"tx_twin_a": source})
    write_distribution(tmp_path, "tactix-twin-b", "2.0", {"twin": "tx_twin_b"}, {"tx_twin_b": source})
    with plugins_on_path(tmp_path):
        twins = [r for r in get_registry().records() if r.name == "twin"]
        assert len(twins) == 2 and all(r.status == "failed" for r in twins)
        assert all("tactix-twin-a" in (r.error or "") and "tactix-twin-b" in (r.error or "") for r in twins)
        with pytest.raises(tactix.DuplicateBackendError, match="tactix-twin-a"):
            get_registry().get("twin")
        assert _decode_runs_on() == "torch"


def test_allow_and_deny_lists_do_not_import_excluded_plugins(
    broken_plugins: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TACTIX_BACKENDS", "torch,misspelt")
    monkeypatch.setenv("TACTIX_DISABLE_BACKENDS", "misspelt")
    with plugins_on_path(broken_plugins):
        records = {r.name: r for r in get_registry().records()}
        assert records["broken"].status == "disabled"
        assert records["broken"].error == "not listed in TACTIX_BACKENDS"
        assert records["misspelt"].status == "disabled"
        assert records["misspelt"].error == "listed in TACTIX_DISABLE_BACKENDS"
        assert "tx_broken_mod" not in sys.modules and "tx_misspelt_mod" not in sys.modules
        assert [b.name for b in get_registry().active()] == ["torch"]


def test_deny_list_can_disable_the_builtin_backend(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TACTIX_BACKENDS", "torch")  # whatever else is installed stays out
    monkeypatch.setenv("TACTIX_DISABLE_BACKENDS", "torch")
    with plugins_on_path(tmp_path):
        with pytest.raises(tactix.BackendUnavailableError, match="TACTIX_DISABLE_BACKENDS"):
            tactix.PagedDecode(backend="torch")
        with pytest.raises(tactix.UnsupportedProblemError, match="no backend is active"):
            _decode_runs_on()


def test_unknown_backend_lists_valid_names() -> None:
    with pytest.raises(tactix.BackendNotFoundError) as info:
        tactix.PagedPrefill(backend="cudnnn")
    assert "'cudnnn'" in str(info.value) and "'torch'" in str(info.value) and "backend" in str(info.value)


def test_importing_tactix_and_discovering_plugins_does_not_initialise_cuda() -> None:
    code = (
        "import tactix, torch\n"
        "from tactix.registry import get_registry\n"
        "get_registry().records()\n"
        "import tactix.backends.torch\n"
        "assert not torch.cuda.is_initialized(), 'CUDA was initialised'\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_op_preference_orders_untuned_auto_per_op() -> None:
    from tactix.backends import torch as torch_backend
    from tactix.registry import Backend, BackendRecord, Registry, plugin_manager

    base = torch_backend.tactix_backends()[0]
    specs = {
        "general": base.model_copy(update={"name": "general", "preference": 10}),
        "decoder": base.model_copy(update={"name": "decoder", "preference": 5, "op_preference": {"decode": 20}}),
    }
    backends = {
        name: Backend(
            record=BackendRecord(name, None, None, "x:y", "active", spec=spec), spec=spec, manager=plugin_manager()
        )
        for name, spec in specs.items()
    }
    registry = Registry(list(b.record for b in backends.values()), backends)
    assert [b.name for b in registry.active()] == ["general", "decoder"]
    assert [b.name for b in registry.active("gemm")] == ["general", "decoder"]
    assert [b.name for b in registry.active("decode")] == ["decoder", "general"]
    assert specs["decoder"].preference_for("prefill") == 5 and specs["decoder"].preference_for("decode") == 20


OLD_STYLE = """
import tactix
from tactix.backends import torch as _torch

NAME = "oldstyle"

@tactix.hookimpl
def tactix_backends():
    return [tactix.BackendSpec(name=NAME, version="0.1", decode=_torch.tactix_backends()[0].decode, preference=99)]

@tactix.hookimpl
def tactix_check(backend, problem, tactic, batch):
    if backend != NAME:  # what every hook had to say before hooks were called per backend
        return None
    return []

@tactix.hookimpl
def tactix_plan_decode(backend, problem, batch, tactic, options):
    if backend != NAME:
        return None
    plan = _torch.tactix_plan_decode(problem, batch, tactix.Tactic.default("torch"), options)
    plan.tactic = tactix.Tactic(backend=NAME, kernel="plain")
    return plan
"""


def test_a_plugin_written_against_the_backend_argument_contract_still_serves(tmp_path: Path) -> None:
    """Hooks that take ``backend`` first and compare it with their name keep working: pluggy
    passes each implementation the arguments it declares, and only this plugin is asked."""
    write_distribution(tmp_path, "tactix-oldstyle", "0.1", {"oldstyle": "tx_oldstyle"}, {"tx_oldstyle": OLD_STYLE})
    with plugins_on_path(tmp_path):
        assert _decode_runs_on("oldstyle") == "oldstyle"
        assert _decode_runs_on() == "oldstyle"  # preference 99: auto's first choice


def test_each_backend_is_answered_by_its_own_plugin_only(tmp_path: Path) -> None:
    """Two plugins that implement the same hooks without looking at the backend name: each
    backend's plan comes from its own plugin (one pluggy manager per backend)."""
    for name in ("alpha", "beta"):
        write_distribution(tmp_path, f"tactix-{name}", "1.0", {name: f"tx_{name}"},
                           {f"tx_{name}": delegating_plugin(name, preference=0)})  # fmt: skip
    with plugins_on_path(tmp_path):
        assert _decode_runs_on("alpha") == "alpha" and _decode_runs_on("beta") == "beta"
        for name in ("alpha", "beta"):
            problem = tactix.DecodeProblem(
                device_type="cpu",
                num_qo_heads=4,
                num_kv_heads=2,
                head_dim_qk=16,
                head_dim_vo=16,
                page_size=4,
                kv_layout="NHD",
                q_dtype="float32",
                kv_dtype="float32",
                out_dtype="float32",
                sm_scale=0.25,
                window_left=-1,
                logits_soft_cap=0.0,
                return_lse=False,
                batch_size=1,
                max_kv_len=3,
            )
            [tactic] = [t for t in get_registry().get(name).tactics(problem) if not t.is_default]
            assert tactic.backend == name


def test_a_plugin_registered_later_on_a_backends_manager_is_asked_and_forgotten_when_removed() -> None:
    """The core calls a hook's one implementation directly (pluggy's dispatch costs microseconds a
    plan); what is registered on the manager afterwards must still take part, as pluggy would have
    it, and stop taking part once it is removed."""
    asked: list[int] = []

    class Watcher:
        @tactix.hookimpl(tryfirst=True)
        def tactix_plan_decode(self, problem: object) -> None:
            asked.append(1)  # returns None: pluggy goes on to the backend's own implementation

    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    wrapper = tactix.PagedDecode("HND", backend="torch", device="cpu")

    def plan() -> None:
        wrapper.plan(i32(0, 1, 3), i32(5, 0, 2), i32(5, 8), 4, 4, 32, 8, q_data_type=torch.float32)

    plan()  # the direct call is set up
    manager = get_registry().get("torch").manager
    watcher = Watcher()
    manager.register(watcher)
    try:
        plan()
        out = wrapper.run(torch.randn(2, 4, 32), (torch.randn(6, 4, 8, 32), torch.randn(6, 4, 8, 32)))
        assert asked == [1] and out.shape == (2, 4, 32)
    finally:
        manager.unregister(watcher)
    plan()
    assert asked == [1]
