"""Per-family differences are declared in one place, dflash_cli/families/ (issue 57: a family is a module).

Code elsewhere reads a family's traits (`family_for(model_type).moe`, `FAMILIES[recipe.family].thinking_switch`)
and never tests a family or a Hugging Face `model_type` by name: a new family is then one module there, not a
hunt for every `== "qwen3"`. Modules are read with `ast`, never imported. Comparing two variables
(pairing/pair.py: the recipe's family against the checkpoint's) is no by-name test and is not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dflash_cli"
REGISTRY = PACKAGE / "families"  # the registry and one module per family: names belong there
NAMED = ("family", "model_type")  # what a by-name test compares
_OPS = (ast.Eq, ast.NotEq, ast.In, ast.NotIn, ast.Is, ast.IsNot)


def _key(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def names_a_family(node: ast.AST) -> bool:
    """`family`, `recipe.family`, `cfg.model_type`, `cfg.get("model_type")`, `getattr(c, "model_type")`,
    `d["family"]`."""
    if isinstance(node, ast.Name | ast.Attribute):
        name = node.id if isinstance(node, ast.Name) else node.attr
        return name.lower().endswith(NAMED)
    if isinstance(node, ast.Subscript):
        return _key(node.slice) in NAMED
    if isinstance(node, ast.Call) and node.args:
        func = node.func
        getter = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)  # d.get, a local get
        by_get = getter == "get" and _key(node.args[0]) in NAMED
        by_getattr = isinstance(func, ast.Name) and func.id == "getattr" and len(node.args) > 1
        return by_get or (by_getattr and _key(node.args[1]) in NAMED)
    return False


def _str_literals(node: ast.AST) -> bool:
    """ "qwen3", ("gemma4", "gemma4_text"), ["a"], {"a"}, frozenset({"a"})."""
    if _key(node) is not None:
        return True
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("frozenset", "set", "tuple"):
        return len(node.args) == 1 and _str_literals(node.args[0])
    return isinstance(node, ast.Tuple | ast.List | ast.Set) and bool(node.elts) and all(map(_str_literals, node.elts))


def name_constants(tree: ast.Module) -> set[str]:
    """Module-level names bound to names (`SLOT_CACHE_FAMILIES = ("qwen3", ...)`): `in SLOT_CACHE_FAMILIES` counts."""
    out = set()
    for node in tree.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if getattr(node, "value", None) is not None and _str_literals(node.value):
            out |= {t.id for t in targets if isinstance(t, ast.Name)}
    return out


def by_name_tests(source: str, filename: str = "<src>") -> list[str]:
    """'file:line: code' for each test of a family or model_type against names written in the code."""
    tree = ast.parse(source, filename)
    consts = name_constants(tree)

    def literal(node: ast.AST) -> bool:
        return _str_literals(node) or (isinstance(node, ast.Name) and node.id in consts)

    found = []
    for node in sorted(ast.walk(tree), key=lambda n: getattr(n, "lineno", 0)):
        hit = False
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            hit = any(
                isinstance(op, _OPS) and ((names_a_family(a) and literal(b)) or (literal(a) and names_a_family(b)))
                for op, a, b in zip(node.ops, sides, sides[1:])
            )
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):  # model_type.startswith("qwen3_5")
            prefix = node.func.attr in ("startswith", "endswith") and names_a_family(node.func.value)
            hit = prefix and bool(node.args) and literal(node.args[0])
        elif isinstance(node, ast.Match) and names_a_family(node.subject):
            hit = any(isinstance(p, ast.MatchValue) for c in node.cases for p in ast.walk(c.pattern))
        if hit:
            found.append(f"{filename}:{node.lineno}: {ast.get_source_segment(source, node)}")
    return found


def package_by_name_tests(package: Path = PACKAGE, registry: Path = REGISTRY) -> list[str]:
    found = []
    for path in sorted(package.rglob("*.py")):
        if not path.is_relative_to(registry):
            found += by_name_tests(path.read_text(), str(path.relative_to(package.parent)))
    return found


def test_no_family_is_tested_by_name_outside_the_registry():
    found = package_by_name_tests()
    assert not found, (
        f"{len(found)} by-name family test(s) outside dflash_cli/families/; declare the difference as a Family "
        "trait there and read it (family_for(model_type).TRAIT):\n" + "\n".join(found)
    )


def test_the_scan_sees_each_form():
    flagged = [
        'if recipe.family == "qwen3": pass',
        'x = cfg.model_type != "gpt_oss"',
        'x = cfg.get("model_type") in ("gemma4", "gemma4_text")',
        'x = "llama" == family',
        'x = getattr(cfg, "model_type", "") in ["a", "b"]',
        'x = get("model_type") == "gpt_oss"',
        'x = d["family"] not in {"a"}',
        'S = ("qwen3", "llama")\nx = self.family not in S',
        'S = frozenset({"qwen3"})\nx = family in S',
        'x = cfg.model_type.startswith("qwen3_5")',
        'match recipe.family:\n    case "qwen3": pass',
    ]
    for src in flagged:
        assert by_name_tests(src), src
    clean = [
        "x = recipe.family != family.model_type",  # two variables (pairing/pair.py)
        "x = family_for(cfg.model_type).moe",
        'x = cfg.get("backend") == "qaic"',
        'x = {"model_type": "qwen3"}',
        "x = model_type in (f.model_type, *f.model_types)",
    ]
    for src in clean:
        assert not by_name_tests(src), src


def test_each_vision_family_declares_its_image_path():
    """A family taking images has Gemma 4's pooled tower or an M-RoPE model (image_inputs.rope_index), not both."""
    from dflash_cli.families import FAMILIES

    for fam in FAMILIES.values():
        paths = fam.pooled_vision + (fam.mrope_model is not None)
        assert paths == fam.vision, fam.model_type
