"""The tree keeps the layout docs/architecture.md draws: each rule read off the source, without importing it.

A failure names the file and what broke the rule: a loose module too many in rlhf/, a runtime import in the
leaf config, an import of the PPO program from below it, a read of another module's private name, library
code in tools/ (a test calling more than a tool's ``main``), a function past 80 lines, a scenario launched
from a test it is not named for.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rlhf"


def _sources(*folders: str) -> dict:
    """{path relative to the root: parsed module} of the Python files under ``folders``."""
    return {str(p.relative_to(ROOT)): ast.parse(p.read_text(), str(p))
            for folder in folders for p in sorted((ROOT / folder).rglob("*.py"))}


def _imported_modules(tree: ast.Module) -> set:
    """Every module ``tree`` imports (``from a.b import c`` counts as ``a.b`` and ``a.b.c``)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def test_rlhf_holds_at_most_ten_loose_modules():
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(loose) <= 10, loose


def test_the_shared_config_is_a_leaf():
    imported = _imported_modules(_sources("rlhf")["rlhf/config.py"])
    runtime = sorted(m for m in imported if re.match(r"rlhf\.(pipeline|schedule|data|optim|ppo|reward_model)\b", m)
                     or (m.startswith("rlhf.parallel.") and m not in ("rlhf.parallel.placement",
                                                                        "rlhf.parallel.placement.load_plan")))
    assert runtime == []


def test_nothing_below_the_programs_imports_them():
    for path, tree in _sources("rlhf").items():
        imported = _imported_modules(tree)
        if not path.startswith("rlhf/ppo/"):
            assert not any(m == "rlhf.ppo" or m.startswith("rlhf.ppo.") for m in imported), path
        if not path.startswith(("rlhf/ppo/", "rlhf/reward_model/")):
            assert not any(m.startswith("rlhf.reward_model") for m in imported), path


def _private_reads(tree: ast.Module) -> list:
    """``from rlhf.x import _y`` and ``alias._y`` where ``alias`` names one of our modules."""
    modules, found = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update({(a.asname or a.name.split(".")[0]): a.name for a in node.names if a.name.startswith("rlhf")})
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rlhf"):
            found += [f"from {node.module} import {a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
            modules.update({(a.asname or a.name): f"{node.module}.{a.name}" for a in node.names})
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name) and node.value.id in modules):
            found.append(f"{node.value.id}.{node.attr}")
    return found


def test_no_module_reads_another_modules_private_names():
    reads = {path: r for path, tree in _sources("rlhf", "tests", "benchmarks", "tools").items()
             if (r := _private_reads(tree))}
    assert reads == {}


def test_tests_call_only_a_tools_main():
    calls = {}
    for path, tree in _sources("tests").items():
        tools = {target.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
                 and isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") == "load_tool"
                 for target in node.targets if isinstance(target, ast.Name)}
        used = sorted({f"{n.value.id}.{n.attr}" for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                       and isinstance(n.value, ast.Name) and n.value.id in tools and n.attr != "main"})
        if used:
            calls[path] = used
    assert calls == {}


def test_no_function_is_longer_than_80_lines():
    long = [f"{path}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path, tree in _sources("rlhf", "tools", "benchmarks").items() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80]
    assert long == []


def test_a_scenario_is_launched_only_by_the_tests_named_for_it():
    wrong = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for scenario in re.findall(r"[\"'](scenario_\w+):", path.read_text()):
            assert (ROOT / "tests" / f"{scenario}.py").is_file(), (path.name, scenario)
            if not path.name.startswith("test_" + scenario[len("scenario_"):]):
                wrong.append((path.name, scenario))
    assert wrong == []


def test_every_folder_of_rlhf_is_a_package_the_install_ships():
    """setup.py's find_packages ships only folders with an __init__.py: a namespace folder would be missing
    from a non-editable install (the Docker image)."""
    folders = {p.parent for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
    assert sorted(str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").is_file()) == []
