"""Static device check: every tensor kvlab creates says where it lives.

A CPU-only CI cannot see a tensor created on the CPU next to a model on ``cuda``; the bug only shows on
a GPU (issue 29's first table). So every tensor factory in ``src/kvlab`` must name its ``device=``, or
follow a source (``torch.*_like``, ``x.new_*``: not factories here), or carry a comment
``# device: <reason>`` on its line (or the line above) saying why the default is right there (token ids
from a tokenizer, host-side metadata, a numpy interchange). ``torch.from_numpy`` always makes a CPU
tensor: it needs the annotation unless it is immediately ``.to(<device>)``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "kvlab"

#: ``torch.<name>(...)`` calls that allocate a new tensor on the default device unless told otherwise.
FACTORIES = frozenset(
    {
        "arange",
        "range",
        "zeros",
        "ones",
        "empty",
        "full",
        "tensor",
        "as_tensor",
        "asarray",
        "scalar_tensor",
        "eye",
        "linspace",
        "logspace",
        "randn",
        "rand",
        "randint",
        "randperm",
        "normal",
        "empty_strided",
        "tril_indices",
        "triu_indices",
        "frombuffer",
        "from_numpy",
    }
)
_ANNOTATION = re.compile(r"#\s*device:\s*\S")
_DTYPES = frozenset(
    name
    for name in dir(__import__("torch"))
    if isinstance(getattr(__import__("torch"), name, None), __import__("torch").dtype)
)


def _is_torch_attr(node: ast.AST, names: frozenset[str]) -> str | None:
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "torch"
        and node.attr in names
    ):
        return node.attr
    return None


def _moves_device(call: ast.Call) -> bool:
    """``<expr>.to(...)`` with a device: a ``device=`` keyword or a first argument that is not a dtype."""
    if any(k.arg == "device" for k in call.keywords):
        return True
    return bool(call.args) and _is_torch_attr(call.args[0], _DTYPES) is None


def findings(source: str, filename: str = "<snippet>") -> list[str]:
    """``file:line: torch.<name>(...)`` for every factory call in ``source`` without a device or a reason."""
    tree = ast.parse(source, filename)
    lines = source.splitlines()
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _is_torch_attr(node.func, FACTORIES)
        if name is None:
            continue
        if name != "from_numpy" and any(k.arg == "device" for k in node.keywords):
            continue
        if name == "from_numpy":  # torch.from_numpy(a).to(device)
            attr = parents.get(node)
            call = parents.get(attr) if attr is not None else None
            if (
                isinstance(attr, ast.Attribute)
                and attr.attr == "to"
                and isinstance(call, ast.Call)
                and _moves_device(call)
            ):
                continue
        first, last = node.lineno, node.end_lineno or node.lineno
        span = lines[max(0, first - 2) : last]
        if any(_ANNOTATION.search(line) for line in span):
            continue
        out.append((first, f"{filename}:{first}: torch.{name}(...) without device= or '# device: <reason>'"))
    return [text for _, text in sorted(out)]


def test_every_factory_in_the_library_names_its_device() -> None:
    problems = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC.parents[1]).as_posix()
        problems += findings(path.read_text(), rel)
    assert not problems, f"{len(problems)} tensor factories without a device:\n" + "\n".join(problems)


def test_the_check_finds_a_missing_device() -> None:
    snippet = (
        "import torch\n"
        "a = torch.arange(5)\n"
        "b = torch.zeros(\n    3,\n    dtype=torch.float32,\n)\n"
        "c = torch.from_numpy(x).float()\n"
        "d = torch.from_numpy(x).to(torch.float32)\n"
    )
    found = findings(snippet)
    assert [f.split(":")[1] for f in found] == ["2", "3", "7", "8"], found


def test_the_check_accepts_devices_and_reasons() -> None:
    snippet = (
        "import torch\n"
        "a = torch.arange(5, device=x.device)\n"
        "b = torch.tensor(ids)  # device: token ids from the tokenizer\n"
        "# device: host-side metadata\n"
        "c = torch.zeros(3)\n"
        "d = torch.from_numpy(x).to(keys.device)\n"
        "e = torch.from_numpy(x).to(device=dev, dtype=torch.float32)\n"
        "f = torch.zeros_like(x) + x.new_zeros(3)\n"
        "g = torch.ones(\n    4,\n    device=dev,\n)\n"
    )
    assert findings(snippet) == []
