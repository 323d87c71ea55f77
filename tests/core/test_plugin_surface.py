"""Backend plugins import only ``tactix`` and ``tactix.plugin``: the rest of the package is private.

Checked on the source of every plugin in this repository and the example plugin, so a plugin
that reaches into a private module (``tactix.staging``, ``tactix.autotune.store``, ...) fails
here instead of breaking when that module changes.
"""

from __future__ import annotations

import ast
import pkgutil
from pathlib import Path

import pytest

import tactix
import tactix.plugin

ROOT = Path(__file__).resolve().parents[2]
PLUGIN_SOURCES = sorted((ROOT / "plugins").glob("*/src/*/**/*.py")) + sorted((ROOT / "examples").glob("*/src/**/*.py"))
ALLOWED = {"tactix", "tactix.plugin"}
SUBMODULES = {m.name for m in pkgutil.iter_modules(tactix.__path__)} - {"plugin"}


def tactix_imports(path: Path) -> list[str]:
    """Each use of tactix in ``path`` that is not the public surface, as ``line: what``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if (node.module == "tactix" or node.module.startswith("tactix.")) and node.module not in ALLOWED:
                found.append(f"{node.lineno}: from {node.module} import ...")
            if node.module == "tactix":
                found += [f"{node.lineno}: from tactix import {a.name}" for a in node.names if a.name in SUBMODULES]
        elif isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names
                      if a.name.startswith("tactix.") and a.name not in ALLOWED]  # fmt: skip
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "tactix"
            and node.attr in SUBMODULES
        ):
            found.append(f"{node.lineno}: tactix.{node.attr}")
    return found


def test_there_are_plugin_sources_to_check() -> None:
    packages = {p.relative_to(ROOT).parts[:2] for p in PLUGIN_SOURCES}
    assert {
        ("plugins", "cudnn"),
        ("plugins", "cuda_native"),
        ("plugins", "trtllm"),
        ("examples", "naive-decode"),
    } <= packages


@pytest.mark.parametrize("path", PLUGIN_SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_plugins_import_only_the_public_surface(path: Path) -> None:
    assert tactix_imports(path) == [], f"{path.relative_to(ROOT)} uses private tactix modules"


def test_the_checker_sees_private_imports(tmp_path: Path) -> None:
    source = tmp_path / "p.py"
    source.write_text("import tactix.cudart\nfrom tactix.staging import Staging\nfrom tactix import staging\n"
                      "import tactix\nx = tactix.autotune.store\nfrom tactix.plugin import Staging\n")  # fmt: skip
    assert [f.split(":")[0] for f in tactix_imports(source)] == ["1", "2", "3", "5"]


def test_the_surface_lists_what_it_exports() -> None:
    assert all(hasattr(tactix.plugin, name) for name in tactix.plugin.__all__)
    assert len(set(tactix.plugin.__all__)) == len(tactix.plugin.__all__)


def test_the_stale_slot_declaration_names_exactly_the_kits_stale_slot_cases() -> None:
    from tactix.registry import get_registry
    from tactix.testing.cases import attention_cases
    from tactix.testing.plugin import id_pattern

    declared = tactix.plugin.stale_slot_failures("prefill")
    for op in ("prefill", "decode"):
        for case in attention_cases(op, get_registry().get("torch").spec.capabilities(op)):  # type: ignore[arg-type]
            matched = any(id_pattern(glob).fullmatch(case.id) for glob in declared)
            assert matched == (op == "prefill" and case.stale != "large"), case.id


def test_a_re_plan_starts_from_the_static_part_alone() -> None:
    """`keep_static` / `from_static`, the plugins' fast re-plan idiom: the new object has the
    static attributes (shared, not copied) and none of the batch's, without ``__init__``."""
    from tactix.plugin import from_static, keep_static

    class Plan:
        inits = 0

        def __init__(self) -> None:
            Plan.inits += 1
            self.kernel = object()
            self.scalars = (1, 2.0)
            keep_static(self)
            self.batch_part = [3, 4]

    first = Plan()
    second = from_static(first)
    assert type(second) is Plan and Plan.inits == 1
    assert second.kernel is first.kernel and second.scalars == (1, 2.0)
    assert not hasattr(second, "batch_part")
    third = from_static(second)  # a re-plan of a re-plan still starts from the first's static part
    assert third.kernel is first.kernel and not hasattr(third, "batch_part")
