"""The codebase stays readable: no import cycles between pipeline_src's modules, no function longer
than a screen and a half, and the training loop on one screen."""
import ast
import inspect
from pathlib import Path

import pytest

from pipeline_src.study import imports
from pipeline_src.train import trainer

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pipeline_src"
MAX_FUNCTION_LINES = 80
MAX_LOOP_LINES = 60


def import_graph() -> dict[str, set[str]]:
    """module -> the pipeline_src modules it imports (any import statement, top level or inside a function)."""
    return {m: set(targets) for m, targets in imports.import_graph().items()}


# The package in layers, lowest first: a module imports only from its own layer or lower ones, so
# that a report stage never runs the trainer, nor a stage the code that writes the DAG. A folder
# may span layers; a package whose __init__ imports nothing sits in the lowest one.
LAYERS = {
    "foundation": {"common", "study", "study.imports", "study.config", "study.claims_config", "study.paths",
                   "runtime", "runtime.allocator", "runtime.machine", "train", "tune", "evaluate", "node"},
    "building blocks": {"data", "data.demo", "data.download", "data.filter", "data.tokens", "data.bpe", "model",
                        "model.accounting", "model.attention", "model.checkpoint", "model.config", "model.copy",
                        "model.decode", "model.layers", "model.positions", "evaluate.static_decode",
                        "model.transformer", "evaluate.metrics", "train.batching", "train.compiling", "train.optim",
                        "train.precision", "train.preemption", "train.live_log", "train.step_meter", "train.state",
                        "train.outputs", "study.convergence", "study.screening", "study.seed_plan",
                        "runtime.gpu_slots"},
    "training and evaluation stages": {"train.trainer", "tune.lr_trials", "evaluate.evaluator"},
    "report stages": {"report", "report.aggregate", "report.build", "report.claims", "report.figures",
                      "report.plan", "report.promote", "report.stats", "report.tables", "report.views",
                      "report.exp_show", "report.reference"},
    "stage table, drivers and runtime": {"study.stages", "study.code_manifest", "study.estimate", "runtime.dvc_yaml",
                                         "runtime.preload",
                                         "runtime.run_lock", "runtime.scheduler_timers", "runtime.slurm_guard",
                                         "node.parts", "node.parts_layout", "__main__"},
}


def _layer_of() -> dict[str, int]:
    return {f"pipeline_src.{m}" if m else "pipeline_src": i for i, mods in enumerate(LAYERS.values()) for m in mods}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_between_modules():
    graph = import_graph()
    assert "pipeline_src.train.state" in graph["pipeline_src.train.trainer"]  # the graph sees relative imports
    assert cycles(graph) == []


def test_every_module_has_a_layer_and_no_import_runs_up_the_layers():
    """Function-local imports count like top-level ones: they run as surely, only later."""
    layer, names = _layer_of(), list(LAYERS)
    graph = import_graph()
    assert sorted(set(graph) - set(layer) - {"pipeline_src"}) == []  # a new module: give it its layer
    upward = [f"{m} ({names[layer[m]]}) imports {t} ({names[layer[t]]})"
              for m, targets in graph.items() if m in layer for t in sorted(targets) if layer[t] > layer[m]]
    assert upward == []
    mods = imports.modules()
    local = [(m, t) for m, path in mods.items() for t, top in imports.imported(m, path, mods) if not top]
    assert local, "the graph sees imports inside functions"
    assert all((m, t) in {(a, b) for a, bs in graph.items() for b in bs} for m, t in local)


def test_the_layer_check_finds_an_upward_import(tmp_path, monkeypatch):
    """An evaluation stage that reads the stage table (the DAG's layer) is caught."""
    graph = import_graph()
    graph["pipeline_src.evaluate.evaluator"] = graph["pipeline_src.evaluate.evaluator"] | {"pipeline_src.study.stages"}
    monkeypatch.setattr(imports, "import_graph", lambda: graph)
    with pytest.raises(AssertionError, match="pipeline_src.evaluate.evaluator .training and evaluation stages. imports "
                                             "pipeline_src.study.stages"):
        test_every_module_has_a_layer_and_no_import_runs_up_the_layers()


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_function_longer_than_a_screen_and_a_half():
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []


def test_the_training_loop_fits_one_screen():
    lines = len(inspect.getsource(trainer.Trainer.train).splitlines())
    assert lines <= MAX_LOOP_LINES, lines
