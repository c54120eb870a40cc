"""The code's shape, checked: layers import only downwards, no module reaches for another's private names, no module
grows past what one reader can hold. These rules are what keep each job with one owner (docs/DESIGN.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# A package may import only packages of a lower layer (or itself): pallas_kernels <- model <- lora <- engine <- serve.
# ``tools`` (synthetic checkpoints) writes PEFT dirs with the reader's rules and the demo server uses it: above lora,
# beside the engine (neither imports the other).
LAYERS = {"pallas_kernels": 0, "slora_jax.model": 1, "slora_jax.lora": 2, "slora_jax.tools": 3,
          "slora_jax.engine": 3, "slora_jax.serve": 4}
MAX_LINES = 500


def _modules() -> list[Path]:
    return sorted(p for d in ("slora_jax", "pallas_kernels") for p in (ROOT / d).rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(module: str) -> str | None:
    return next((p for p in sorted(LAYERS, key=len, reverse=True) if module == p or module.startswith(p + ".")),
                None)


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, absolute module, imported names) of every import in the file, function-level ones included."""
    me = _module_name(path)
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = me.split(".")
                base = base if is_pkg else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.append((node.lineno, module, [alias.name for alias in node.names]))
    return out


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_is_short(path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, f"{n} lines: split it by job"


def test_imports_point_down_the_layers():
    bad = []
    for path in _modules():
        src = _package(_module_name(path))
        for line, module, _ in _imports(path):
            dst = _package(module)
            if src and dst and dst != src and LAYERS[dst] >= LAYERS[src]:
                bad.append(f"{path.relative_to(ROOT)}:{line} ({src}) imports {module} ({dst})")
    assert not bad, "\n".join(bad)


def test_no_private_names_cross_modules():
    bad = []
    for path in _modules():
        me = _module_name(path)
        for line, module, names in _imports(path):
            if module == "__future__" or not _package(module) or module == me:
                continue
            private = [n for n in names if n.startswith("_")]
            if private or any(part.startswith("_") for part in module.split(".")):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {private or module} from {module}")
    assert not bad, "\n".join(bad)


def test_the_checks_see_real_imports():
    """Guard against a checker that passes because it finds nothing."""
    engine = ROOT / "slora_jax" / "engine" / "engine.py"
    modules = {m for _, m, _ in _imports(engine)}
    assert {"slora_jax.engine.scheduler", "slora_jax.model.config"} <= modules
    assert _package("slora_jax.serve.app") == "slora_jax.serve" and _package("numpy") is None
