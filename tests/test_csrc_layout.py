"""The layout rules of csrc/ (csrc/README.md) and docs/ops.md's per-op map, and where the Python
side of each op family sits (te_ep_torch/ops/<family>.py), read from the sources: no build needed.

The rule that matters most: a file in a family's core/ folder is torch-free. It includes no
torch, ATen, c10, caffe2, pybind11 or Python header, and of the project's headers only ones
in a core/ folder, so no torch header reaches it through a project header either.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

CSRC = Path(__file__).resolve().parents[1] / "csrc"
SOURCE_SUFFIXES = {".h", ".cuh", ".cpp", ".cu"}
# Headers of torch and of what a torch extension builds on; none may reach a core/ file.
FRAMEWORK_HEADERS = ("torch/", "ATen/", "c10/", "caffe2/", "pybind11/", "Python.h")
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.MULTILINE)


def _sources() -> list[Path]:
    return sorted(p for p in CSRC.rglob("*") if p.suffix in SOURCE_SUFFIXES)


def _is_core(path: Path) -> bool:
    return path.parent.name == "core"


def _includes(path: Path) -> list[tuple[str, str]]:
    """(kind, name) of every #include, inside #if blocks too: a conditional include is still one."""
    return INCLUDE.findall(path.read_text())


def _torch_free_problems(path: Path) -> list[str]:
    """What makes `path` (a core/ file) not torch-free: the chain to each framework header it
    reaches through the project's headers, and each project header outside core/ it includes."""
    problems = []
    seen = set()
    stack = [(path, [path])]
    while stack:
        current, chain = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        via = " -> ".join(str(p.relative_to(CSRC)) for p in chain)
        for kind, name in _includes(current):
            if name.startswith(FRAMEWORK_HEADERS):
                problems.append(f"{via} includes {kind}{name}{'>' if kind == '<' else kind}")
                continue
            if kind != '"':
                continue  # the C++ library, CUDA, NCCL: not the project's
            header = CSRC / name
            if not header.is_file():
                problems.append(f'{via} includes "{name}", which is not a file under csrc/ (spell project '
                                "includes from csrc/)")
                continue
            if current == path and not _is_core(header):
                problems.append(f'{via} includes "{name}", a torch-side header (core/ includes only core/)')
            stack.append((header, chain + [header]))
    return problems


def test_core_files_reach_no_torch_header():
    core = [p for p in _sources() if _is_core(p)]
    assert core, "no csrc/<family>/core/ files found"
    problems = [problem for path in core for problem in _torch_free_problems(path)]
    assert not problems, "core/ files must be torch-free (csrc/README.md):\n" + "\n".join(problems)


def test_every_source_sits_in_a_family_folder_or_its_core():
    misplaced = []
    for path in _sources():
        parts = path.relative_to(CSRC).parts
        if parts == ("library.cpp",):
            continue
        if len(parts) == 2 or (len(parts) == 3 and parts[1] == "core"):
            continue
        misplaced.append("/".join(parts))
    assert not misplaced, ("csrc/ holds library.cpp and csrc/<family>/[core/]<file> only (csrc/README.md): "
                           f"{misplaced}")


def test_one_schema_block_and_registrations_in_ops_files():
    blocks = []
    registrations = []
    for path in _sources():
        text = path.read_text()
        rel = str(path.relative_to(CSRC))
        blocks += [rel] * len(re.findall(r"^\s*TORCH_LIBRARY\(", text, re.MULTILINE))
        if re.search(r"^\s*TORCH_LIBRARY_IMPL\(", text, re.MULTILINE):
            registrations.append(path)
    assert blocks == ["library.cpp"], f"one TORCH_LIBRARY block, in csrc/library.cpp; found {blocks}"
    outside = [str(p.relative_to(CSRC)) for p in registrations if not p.name.endswith("_ops.cpp") or _is_core(p)]
    assert not outside, f"TORCH_LIBRARY_IMPL outside a family's *_ops.cpp: {outside}"


# Which families a family's files may include (csrc/README.md): downwards only.
MAY_INCLUDE = {
    "common": set(),
    "watchdog": {"common"},
    "permute": {"common"},
    "zones": {"common"},
    "fp8": {"common"},
    "comm": {"common", "watchdog"},
    "nccl_ep": {"common", "watchdog", "comm"},
}


def test_families_include_each_other_downwards_only():
    families = {p.relative_to(CSRC).parts[0] for p in _sources() if len(p.relative_to(CSRC).parts) > 1}
    assert families == set(MAY_INCLUDE), (f"families in csrc/: {sorted(families)}; MAY_INCLUDE names "
                                          f"{sorted(MAY_INCLUDE)}")
    upward = []
    for path in _sources():
        parts = path.relative_to(CSRC).parts
        family = parts[0] if len(parts) > 1 else None
        for kind, name in _includes(path):
            if kind != '"':
                continue
            target = name.split("/", 1)[0]
            if family is None:
                upward.append(f"{path.relative_to(CSRC)} includes {name}")
            elif target != family and target not in MAY_INCLUDE[family]:
                upward.append(f"{path.relative_to(CSRC)} ({family}/) includes {name} ({target}/)")
    assert not upward, "includes against the family order of csrc/README.md:\n" + "\n".join(upward)


# ---- docs/ops.md's per-op map names every op of csrc/library.cpp, with its schema -------------

OPS_MD = CSRC.parent / "docs" / "ops.md"


def _schemas() -> dict[str, str]:
    """Every m.def of csrc/library.cpp: op name -> schema (its string literals joined)."""
    text = (CSRC / "library.cpp").read_text()
    schemas = {}
    for call in re.findall(r'm\.def\(\s*((?:"(?:[^"\\]|\\.)*"\s*)+)\)', text):
        schema = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', call)).replace('\\"', '"')
        schemas[schema.split("(", 1)[0]] = schema
    return schemas


def _split_top(text: str) -> list[str]:
    """`text` split at the commas outside parentheses."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += c == "("
        depth -= c == ")"
        if c == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    tail = text[start:].strip()
    return parts + [tail] if tail else parts


def short_schema(schema: str) -> str:
    """The map's short form of a schema: argument names without types; `(a!)` after a mutated
    argument, `?` after an optional one, and defaults other than None; returns by name where
    named, else by type."""
    args, ret = schema.split("(", 1)[1].rsplit(") -> ", 1)
    short_args = []
    for arg in _split_top(args):
        type_, _, var = arg.rpartition(" ")
        var, _, default = var.partition("=")
        short = var + ("(a!)" if "(a!)" in type_ else "") + ("?" if type_.endswith("?") else "")
        if default and default != "None":
            short += "=" + default
        short_args.append(short)

    def short_ret(r: str) -> str:
        return r.rpartition(" ")[2] if " " in r else r

    if ret.startswith("(") and ret != "()":
        ret = "(" + ", ".join(short_ret(r) for r in _split_top(ret[1:-1])) + ")"
    return f"({', '.join(short_args)}) -> {ret}"


def _map_rows() -> list[list[str]]:
    text = OPS_MD.read_text()
    section = text.split("\n## Per-op map\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows]


def test_per_op_map_has_one_row_per_op_with_its_schema():
    schemas = _schemas()
    rows = _map_rows()
    names = [row[0].strip("`") for row in rows]
    assert sorted(names) == sorted(schemas), (
        f"docs/ops.md's per-op map lacks {sorted(set(schemas) - set(names))} and has ops that "
        f"csrc/library.cpp does not declare: {sorted(set(names) - set(schemas))}")
    assert len(names) == len(set(names)), f"ops with two rows: {[n for n in names if names.count(n) > 1]}"
    wrong = []
    for row in rows:
        expected = f"`{short_schema(schemas[row[0].strip('`')])}`"
        if row[1] != expected:
            wrong.append(f"{row[0]}: the map says {row[1]}, library.cpp's schema gives {expected}")
    assert not wrong, "\n".join(wrong)


def test_per_op_map_names_files_that_exist():
    missing = []
    for row in _map_rows():
        for cell in row[2:]:
            for path in re.findall(r"`([\w./-]+\.(?:cpp|cu|h|py))`", cell):
                if not ((CSRC / path).is_file() or (CSRC.parent / path).is_file()):
                    missing.append(f"{row[0]}: {path}")
    assert not missing, "paths in docs/ops.md's per-op map (C++ from csrc/, the rest from the root):\n" + "\n".join(
        missing)


# ---- the Python side: each op's fake kernel and autograd formula in its family's module -----------
# te_ep_torch/ops/ has one module per csrc/ family; the map names the module of each fake kernel
# and registered autograd formula. Read from the sources (ast), like the rest of this file.

PACKAGE = CSRC.parent / "te_ep_torch"
# csrc/ family -> its Python module; the nccl_ep family's private ops are called from
# te_ep_torch/_nccl_ep.py and have neither fakes nor autograd.
PY_FAMILY = {family: f"te_ep_torch/ops/{family}.py" for family in ("comm", "fp8", "permute", "zones", "watchdog")}


def _callee(call: ast.Call) -> str:
    """The last name of what `call` calls: `register_fake` of `torch.library.register_fake(...)`."""
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _registrations() -> tuple[dict, dict]:
    """Where the sources register te_ep fakes and autograd formulas:
    ``({op: [(file, function)]}, {op: [file]})``, file relative to the repository root. A fake is a
    function decorated with ``torch.library.register_fake("te_ep::<op>")`` or with
    ``_comm_fake("<op>")`` (ops/comm.py's registrar); a formula is a
    ``torch.library.register_autograd("te_ep::<op>", ...)`` call."""
    fakes: dict = {}
    formulas: dict = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(CSRC.parent))
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                for dec in node.decorator_list:
                    if not (isinstance(dec, ast.Call) and dec.args and isinstance(dec.args[0], ast.Constant)):
                        continue
                    name = dec.args[0].value
                    if _callee(dec) == "register_fake" and name.startswith("te_ep::"):
                        fakes.setdefault(name[len("te_ep::"):], []).append((rel, node.name))
                    elif _callee(dec) == "_comm_fake":
                        fakes.setdefault(name, []).append((rel, node.name))
            elif (isinstance(node, ast.Call) and _callee(node) == "register_autograd" and node.args
                  and isinstance(node.args[0], ast.Constant) and node.args[0].value.startswith("te_ep::")):
                formulas.setdefault(node.args[0].value[len("te_ep::"):], []).append(rel)
    return fakes, formulas


def _family(row: list[str]) -> str:
    """The csrc/ family of a map row: the folder of its C++ adapter."""
    return row[2].split("`")[1].split("/")[0]


def test_fakes_sit_in_the_family_module_the_map_names():
    fakes, _ = _registrations()
    assert fakes, "no fake kernels found under te_ep_torch/"
    rows = {row[0].strip("`"): row for row in _map_rows()}
    wrong = [f"{op}: fake kernels registered in {sorted(fakes[op])} but the op is not in the map"
             for op in sorted(set(fakes) - set(rows))]
    for op, row in rows.items():
        named = re.fullmatch(r"`(\w+)` \(`([\w./]+\.py)`\)", row[5])
        if op not in fakes:
            if not row[5].startswith("none"):
                wrong.append(f"{op}: the map names the fake {row[5]}, the sources register none")
            continue
        if named is None:
            wrong.append(f"{op}: the map's fake cell must be `function` (`te_ep_torch/ops/<family>.py`); "
                         f"it says {row[5]}; the sources register {fakes[op]}")
            continue
        function, file = named.groups()
        if fakes[op] != [(file, function)]:
            wrong.append(f"{op}: the map says {function} in {file}; the sources register {fakes[op]}")
        family_module = PY_FAMILY.get(_family(row))
        if file != family_module:
            wrong.append(f"{op}: its fake is in {file}, not in its family's module {family_module} "
                         f"(the C++ adapter is in csrc/{_family(row)}/)")
    assert not wrong, "fake kernels against docs/ops.md's per-op map:\n" + "\n".join(wrong)


def test_registered_autograd_sits_in_the_family_module_the_map_names():
    _, formulas = _registrations()
    assert formulas, "no register_autograd calls found under te_ep_torch/"
    rows = {row[0].strip("`"): row for row in _map_rows()}
    wrong = [f"{op}: autograd registered in {formulas[op]} but the op is not in the map"
             for op in sorted(set(formulas) - set(rows))]
    for op, row in rows.items():
        named = re.match(r"`register_autograd` \(`([\w./]+\.py)`\)", row[6])
        if op not in formulas:
            if named is not None:
                wrong.append(f"{op}: the map names a registered formula, the sources register none")
            continue
        if named is None:
            wrong.append(f"{op}: the map's autograd cell must start `register_autograd` (`<file>`); it says "
                         f"{row[6]}; the sources register it in {formulas[op]}")
            continue
        if formulas[op] != [named.group(1)]:
            wrong.append(f"{op}: the map says {named.group(1)}; the sources register it in {formulas[op]}")
        if named.group(1) != PY_FAMILY.get(_family(row)):
            wrong.append(f"{op}: its formula is in {named.group(1)}, not in its family's module "
                         f"{PY_FAMILY.get(_family(row))}")
    assert not wrong, "registered autograd formulas against docs/ops.md's per-op map:\n" + "\n".join(wrong)


def test_every_family_module_is_imported_by_the_ops_package():
    """``import te_ep_torch.ops`` registers every fake and formula: its __init__ imports each module."""
    init = ast.parse((PACKAGE / "ops" / "__init__.py").read_text())
    imported = {alias.name for node in ast.walk(init) if isinstance(node, ast.ImportFrom) and node.level == 1
                and node.module is None for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(init)
                 if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module}
    modules = {p.stem for p in (PACKAGE / "ops").glob("*.py") if p.stem != "__init__"}
    assert modules <= imported, f"te_ep_torch/ops/__init__.py does not import {sorted(modules - imported)}"
