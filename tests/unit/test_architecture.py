"""The package's layering, as an executable rule (docs/architecture.md).

- ``trainer.config`` is a leaf: it imports nothing from the rest of ``trainer`` except the
  exception classes of ``trainer.errors`` (which import nothing).
- No import cycles between modules (imports inside functions included), and the packages and
  top-level modules import only from the layers below theirs (``LAYERS``, the order of the docs).
- Planning a job builds the model on the meta device once, and a rank builds it once per chunk.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "trainer"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the trainer modules it imports (anywhere in the file)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # "from trainer.x import y": y may be a submodule or a name in trainer.x
                targets |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                            for a in node.names}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def test_config_is_a_leaf():
    graph = import_graph()
    leaks = {(m, t) for m, ts in graph.items() if m.startswith("trainer.config") for t in ts
             if not t.startswith("trainer.config") and t != "trainer.errors"}
    assert leaks == set()
    assert graph["trainer.errors"] == set()


def test_no_import_cycles():
    graph = import_graph()
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert cycles == []


def test_the_rule_sees_a_violation(tmp_path, monkeypatch):
    """The checker itself: an import of the model registry from config/ is reported."""
    import tests.unit.test_architecture as arch

    fake = tmp_path / "trainer"
    (fake / "config").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "errors.py").write_text("")
    (fake / "models.py").write_text("import trainer.config.schema\n")
    (fake / "config" / "__init__.py").write_text("")
    (fake / "config" / "schema.py").write_text("def f():\n    from trainer.models import x\n")
    monkeypatch.setattr(arch, "PACKAGE", fake)
    with pytest.raises(AssertionError):
        test_config_is_a_leaf()
    with pytest.raises(AssertionError):
        test_no_import_cycles()


# The documented layer order (docs/architecture.md, "Layers"), lowest first: a unit (subpackage or
# top-level module of trainer) may import units of lower layers only (and itself).
LAYERS = [
    ["trainer.errors"],
    ["trainer.log", "trainer.jsonfile", "trainer.dtypes", "trainer.dtensor", "trainer.env", "trainer.watchdog",
     "trainer.loss", "trainer.agreement"],
    ["trainer.config"],
    ["trainer.models"],
    ["trainer.parallel", "trainer.hf", "trainer.hub"],
    ["trainer.data", "trainer.activation_memory"],
    ["trainer.pipeline"],
    ["trainer.plan"],
    ["trainer.dry_run", "trainer.model_parts", "trainer.checkpoint", "trainer.metrics", "trainer.optim",
     "trainer.profiling"],
    ["trainer.evaluate"],
    ["trainer.train"],
    ["trainer.convert", "trainer.launch", "trainer.prepare"],
    ["trainer.generate", "trainer.measure_costs"],
    ["trainer"],
]


def _unit(module: str) -> str:
    return ".".join(module.split(".")[:2])


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    level = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
    missing = sorted({_unit(m) for m in graph} - set(level))
    assert not missing, f"units not placed in LAYERS: {missing}"
    return sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                  if _unit(m) != _unit(t) and level[_unit(t)] >= level[_unit(m)])


def test_units_import_only_lower_layers():
    assert layer_violations(import_graph()) == []


def test_the_layer_check_catches_an_upward_import():
    graph = {"trainer.models.llama": {"trainer.parallel.fsdp"}, "trainer.parallel.fsdp": set()}
    assert layer_violations(graph) == ["trainer.models.llama -> trainer.parallel.fsdp"]
    same_layer = {"trainer.parallel.tp": {"trainer.hf"}, "trainer.hf": set()}
    assert layer_violations(same_layer) == ["trainer.parallel.tp -> trainer.hf"]


def test_only_the_schedule_table_names_a_schedule():
    """A schedule's special cases are traits of trainer/config/schedules.py: no other module compares with a
    schedule's name (the schema's default value is the one other place a name is written)."""
    from trainer.config.schedules import CSV_NAME, SCHEDULES

    names = set(SCHEDULES) | {CSV_NAME}
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).as_posix() in ("config/schedules.py", "config/schema.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.value!r}")
    assert found == []


def test_only_the_plan_and_the_assembly_read_the_whole_config():
    """Components receive their own sections and the plan's derived values: ``<plan>.config`` is read only by
    the plan itself, the trainer assembly (train.py) and the dry run, which print or hand out sections."""
    allowed = {"plan.py", "train.py", "dry_run.py"}
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).as_posix() in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "config":
                owner = node.value
                name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
                if name == "plan":
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert found == []


# Private torch APIs (names with a leading underscore) the package relies on: each is used by exactly one module,
# as narrowly as it can be, and is a row of docs/architecture.md's "Torch seams" table with the version it was
# checked on. A new one fails here until it is listed in both.
TORCH_SEAMS = {
    "torch._grouped_mm": "models/moe/model.py",
    "torch._C._current_graph_task_id": "models/moe/model.py",
    "_last_lr": "optim.py",
    "torch.overrides._get_current_function_mode_stack": "parallel/ac.py",
    "torch.ops.profiler._record_function_*, _RecordFunction": "parallel/ac.py",
    "torch.ops.aten._scaled_dot_product_*": "parallel/ac.py",
    "torch._foreach_mul_": "train.py parallel/clip.py",
    "torch.distributed._functional_collectives": "parallel/cp.py parallel/ep.py",
    "torch.distributed._composable.replicate": "parallel/ddp.py",
    "torch.distributed.distributed_c10d._set_pg_timeout, _world": "parallel/mesh.py",
    "DeviceMesh._flatten": "parallel/mesh.py",
    "torch.distributed.pipelining.schedules._PipelineSchedule, _PipelineScheduleRuntime, _load_csv, _stage, _stages,"
    " _loss_fn":
        "pipeline/runtime.py",
    "torch.distributed.pipelining.stage._PipelineStage, _get_init_p2p_neighbors_ops": "pipeline/runtime.py",
    "nn.Module._non_persistent_buffers_set, nn.modules._BatchNorm, _DropoutNd": "pipeline/runtime.py",
    "torch.distributed.pipelining._schedule_visualizer": "pipeline/simulate.py",
    "torch.utils._python_dispatch, Tensor._base": "profiling/activations.py",
    "torch.cuda.memory._record_memory_history, _dump_snapshot": "profiling/steps.py",
}
# Private names of our own objects (or of the standard library) that the scan below also sees.
OURS = {"_trainer", "_refuse_unless", "_release", "_exit", "_settings"}


def _private_uses() -> dict[str, set[str]]:
    """Module (relative path) -> the private names it uses outside ``self``/``cls``: imported from torch,
    read as attributes, or named in getattr/hasattr."""
    private = lambda name: name.startswith("_") and not name.startswith("__")  # noqa: E731
    uses: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch"):
                found |= ({p for p in node.module.split(".") if private(p)}
                          | {a.name for a in node.names if private(a.name)})
            elif isinstance(node, ast.Attribute) and private(node.attr) and not (
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.add(node.attr)
            elif (isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("getattr", "hasattr", "setattr")
                  and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
                  and isinstance(node.args[1].value, str) and private(node.args[1].value)):
                found.add(node.args[1].value)
        if found - OURS:
            uses[path.relative_to(PACKAGE).as_posix()] = found - OURS
    return uses


def test_private_torch_apis_are_listed_seams():
    import re

    docs = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    table = docs[docs.index("## Torch seams"):]
    for seam, modules in TORCH_SEAMS.items():
        assert seam in table, f"docs/architecture.md, Torch seams: no row for {seam}"
        for module in modules.split():
            assert f"trainer/{module}" in table, f"docs/architecture.md, Torch seams: {seam} does not name {module}"
    listed: dict[str, list[str]] = {}  # module -> listed names; "x_*" lists every name starting "x_"
    for seam, modules in TORCH_SEAMS.items():
        for module in modules.split():
            listed.setdefault(module, []).extend(re.findall(r"_[A-Za-z0-9_]+\*?", seam))
    unlisted = [f"{module}: {name}" for module, names in sorted(_private_uses().items()) for name in sorted(names)
                if not any(name == k or (k.endswith("*") and name.startswith(k[:-1])) for k in listed.get(module, []))]
    assert unlisted == []
