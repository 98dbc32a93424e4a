"""Import layering, checked on the source (``ast``), so the architecture's claims stay true.

* the library never imports the study (``kvlab.study``) or the command line (``kvlab.cli``);
* only the adapter package ``kvlab.hf`` touches transformers' cache classes;
* only ``ModelHandle`` calls the model: no ``<something>.model(`` call anywhere else;
* one implementation each of the ideas that used to exist several times (see the names below).
"""

from __future__ import annotations

import ast
import functools
import re
from collections import Counter
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "kvlab"


@functools.cache
def _modules() -> dict[str, ast.Module]:
    """Every module of the package, parsed once, when a test first asks (not at collection)."""
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        name = ".".join(("kvlab", *path.relative_to(SRC).with_suffix("").parts))
        out[name.removesuffix(".__init__")] = ast.parse(_source(name), filename=str(path))
    return out


@functools.cache
def _source(module: str) -> str:
    return (SRC / _path(module)).read_text()


def _imports(tree: ast.Module) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def _layer(module: str) -> str:
    if module.startswith(("kvlab.cli", "kvlab.__main__")):
        return "cli"
    if module.startswith("kvlab.study"):
        return "study"
    return "library"


def test_modules_found():
    assert "kvlab.model.handle" in _modules() and "kvlab.study.runner" in _modules()


def test_library_never_imports_the_study_or_the_cli():
    bad = [
        f"{mod} imports {imp}"
        for mod, tree in _modules().items()
        if _layer(mod) == "library"
        for imp in _imports(tree)
        if imp.startswith(("kvlab.study", "kvlab.cli"))
    ]
    assert not bad, bad


def test_study_never_imports_the_cli():
    bad = [
        f"{mod} imports {imp}"
        for mod, tree in _modules().items()
        if _layer(mod) == "study"
        for imp in _imports(tree)
        if imp.startswith("kvlab.cli")
    ]
    assert not bad, bad


def test_only_the_adapter_touches_transformers_cache_classes():
    bad = [
        f"{mod} imports {imp}"
        for mod, tree in _modules().items()
        if not mod.startswith("kvlab.hf")
        for imp in _imports(tree)
        if imp.startswith("transformers.cache_utils") or imp in ("transformers.DynamicCache",)
    ]
    assert not bad, bad


def test_only_model_handle_calls_the_model():
    """``x.model(`` outside ``kvlab.model.handle`` would be a second path into the model."""
    bad = []
    for mod, tree in _modules().items():
        if mod == "kvlab.model.handle":
            continue
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "model"
            ):
                bad.append(f"{mod}:{node.lineno}")
    assert not bad, f"direct model calls outside ModelHandle: {bad}"


def test_the_checker_sees_a_direct_model_call():
    tree = ast.parse("def f(handle):\n    return handle.model(input_ids=1)\n")
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "model"
    ]
    assert len(calls) == 1


# Packages in layers: each imports only from layers below it (and itself).
LAYERS = [
    {"errors", "_lazy"},
    {"paths", "loop", "rope", "progress", "probe"},
    {"data", "cache", "kernels"},
    {"metrics"},
    {"policy"},
    {"hf"},
    {"model"},
    {"ops", "streaming", "eval"},
    {"store"},
    {"study", "serve"},
    {"cli"},
    {"__main__"},
]
RANK = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def test_every_package_has_a_layer():
    pkgs = {m.split(".")[1] for m in _modules() if m.count(".") >= 1}
    assert pkgs <= set(RANK), sorted(pkgs - set(RANK))


#: Modules whose methods may import the layers above, inside those methods (and for types): a cache layout
#: builds its live cache (kvlab.hf) and applies itself offline to a context, while reading a spec (its own
#: layer) imports none of that. Their module-level imports still follow the layers.
DEFERRED_UP = ("kvlab.policy.layouts",)


def _eager_imports(tree: ast.AST) -> set[str]:
    """The imports a module runs when it is imported: not inside functions, not under ``if TYPE_CHECKING``."""
    found: set[str] = set()
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found |= _imports(ast.Module(body=[node], type_ignores=[]))
        else:
            found |= _eager_imports(node)
    return found


def test_packages_import_only_from_below():
    bad = []
    for mod, tree in _modules().items():
        if mod == "kvlab":
            continue  # the package root re-exports (lazily)
        here = mod.split(".")[1]
        for imp in _eager_imports(tree) if mod.startswith(DEFERRED_UP) else _imports(tree):
            parts = imp.split(".")
            if parts[0] != "kvlab" or len(parts) < 2 or parts[1] not in RANK or parts[1] == here:
                continue
            if RANK[parts[1]] >= RANK[here]:
                bad.append(f"{mod} imports {imp}")
    assert not bad, bad


ONE_DEFINITION = [
    "recompute_slots",  # ops.recompute (rolled caches and store chunks)
    "first_layers_kv",  # the one first-layers probe (hf.masked)
    "roll_amount",  # the one reader of roll amounts (policy.window)
    "decode_loop",  # the one decode loop (kvlab.loop)
    "SinksWindow",  # the one sinks + window layout
    "concat",  # KVSnapshot concatenation (cache.snapshot)
]
GONE = [
    "partial_prefill_keys",
    "kept_slots",
    "driven_by_generate",
    "_decoder_layers",
    "_check_roll",
    "roll_count",
    "drop_count",
    "token_windows",
    "load_or_run",
    # issue 28, item 3: every offline cache is a KVSnapshot that ModelHandle.forward runs
    "EvictedCache",
    "logits_on_layers",
    "greedy_on_layers",
    "dynamic_cache_from_layers",
    "ragged_logits",
    "ragged_greedy",
    "begin_packed_step",
    # issue 28, item 6: one step context (hf.step), one thread-local, one registered eager attention
    "_rows_attention",
    "_slot_mask_attention",
    "_quantized_attention",
    "_Steps",
    "_Active",
    "_choosing",
]


def test_one_thread_local_and_one_eager_attention_function():
    """Per-forward state lives in one thread-local (kvlab.hf.step) and every eager kvlab cache attends
    through one registered attention function; only the captured decode steps (kvlab.hf.graphs) register
    their own, fixed attention (a CUDA graph or a fullgraph compile cannot consult a thread-local)."""
    locals_ = [m for m in _modules() if "threading.local" in _source(m)]
    assert locals_ == ["kvlab.hf.step"], locals_
    registers = sorted(m for m in _modules() if "AttentionInterface.register(" in _source(m))
    assert registers == ["kvlab.hf.graphs", "kvlab.hf.step"], registers
    assert (SRC / "hf/step.py").read_text().count("AttentionInterface.register(") == 1


def test_roll_means_one_thing():
    """``roll`` is the operation on a cache (ops.suffix.roll); re-running the rolled text is a re-prefill."""
    assert _defined("roll") == ["kvlab.ops.suffix"]


def test_one_implementation_each():
    counts = {name: _defined(name) for name in ONE_DEFINITION}
    assert all(len(where) == 1 for where in counts.values()), counts
    gone = {name: _defined(name) for name in GONE}
    assert not any(gone.values()), gone
    # the only sampling and the only multinomial draw are in the decode loop
    users = [m for m in _modules() if "multinomial(" in _source(m)]
    assert users == ["kvlab.loop"], users


def _defined(name: str) -> list[str]:
    pattern = re.compile(rf"^\s*(def|class) {re.escape(name)}\b", re.M)
    return [mod for mod, _ in _modules().items() if pattern.search(_source(mod))]


def _path(module: str) -> str:
    rel = module.removeprefix("kvlab").lstrip(".").replace(".", "/")
    p = SRC / rel
    return str(p.relative_to(SRC) / "__init__.py") if p.is_dir() else rel + ".py"


def test_experiment_names_equal_module_names():
    from kvlab.study.experiments import registry

    for name, exp in registry().items():
        module = exp.run.__module__.rsplit(".", 1)[-1]
        assert module == name, f"experiment '{name}' lives in module '{module}'"


def test_no_unreachable_statements():
    """Nothing follows a return/raise/continue/break in the same block (a split function that returns early
    would silently drop the figures or rows after it)."""
    bad = []
    for mod, tree in _modules().items():
        for node in ast.walk(tree):
            for field in ("body", "orelse", "finalbody"):
                block = getattr(node, field, None)
                if isinstance(block, list):
                    bad += [
                        f"{mod}:{st.lineno}"
                        for st in block[:-1]
                        if isinstance(st, (ast.Return, ast.Raise, ast.Continue, ast.Break))
                    ]
    assert not bad, bad


def test_experiment_functions_stay_short():
    """Experiments are measure -> records -> tables and figures, each a function under 80 lines."""
    long = [
        f"{mod}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for mod, tree in _modules().items()
        if mod.startswith("kvlab.study.experiments")
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 >= 80
    ]
    assert not long, long


def test_no_private_function_is_left_unused():
    """A module-level ``_helper`` that nothing references is dead code (or a figure a refactor forgot to call).
    One pass over the source: every maximal run of word characters counted once (what ``\\bname\\b``
    finds, without one regex over everything per name)."""
    words = Counter(re.findall(r"\w+", "\n".join(_source(m) for m in _modules())))
    unused = [
        f"{mod}.{node.name}"
        for mod, tree in _modules().items()
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.ClassDef))
        and node.name.startswith("_")
        and not node.name.startswith("__")
        and not node.decorator_list  # registered by its decorator (a typer callback, a fixture)
        and words[node.name] < 2
    ]
    assert not unused, unused
