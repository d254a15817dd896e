"""The package's import graph, read from the source (an AST walk, imports inside functions and
``if TYPE_CHECKING:`` imports included: a type-only import is still a dependency of the design, and
a circle through one is a circle a reader has to untangle).

``tests/test_layout.py`` checks it and ``docs/design.md``'s layer table is generated from ``LAYERS``.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Layer -> (what it holds, the layers it may import). A module belongs to the first layer whose
# prefix matches it. Torch-free layers are marked; the planning side never imports the runtime side.
LAYERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "solver": ("pure planning algorithms on numbers (no torch, no flexsp)", ()),
    "flexsp.errors": ("exception families", ()),
    "flexsp.inputs": ("checked conversions of user values, size parsing", ("flexsp.errors",)),
    "flexsp.plan": ("torch-free planning: specs, memory, cost, cluster, plans, PlanConfig, strategies, plan_batch, bounds",
                    ("solver", "flexsp.errors", "flexsp.inputs")),
    "flexsp.evaluation": ("simulate, comparisons, plots (torch-free)",
                          ("solver", "flexsp.errors", "flexsp.inputs", "flexsp.plan")),
    "flexsp.runtime": ("TrainConfig, pool, SP axes, kernels, token sharding, the step, FSDP, failures, models",
                       ("flexsp.errors", "flexsp.inputs", "flexsp.plan")),
    "flexsp.hf.trl": ("TRL's SFTTrainer under FlexSP: TRL's dataset pipeline, FlexSP's batching and step",
                      ("flexsp.errors", "flexsp.inputs", "flexsp.plan", "flexsp.runtime", "flexsp.hf",
                       "flexsp.hf.trainer", "flexsp.data", "flexsp.telemetry")),
    "flexsp.hf.trainer": ("HF Trainer integration: the planned loader as its dataloader",
                          ("flexsp.errors", "flexsp.inputs", "flexsp.plan", "flexsp.runtime", "flexsp.hf",
                           "flexsp.data", "flexsp.telemetry")),
    "flexsp.hf": ("Hugging Face models behind the runtime's SPModel protocol",
                  ("flexsp.errors", "flexsp.inputs", "flexsp.plan", "flexsp.runtime")),
    "flexsp.data": ("the planned data loader and its planner process",
                    ("flexsp.errors", "flexsp.inputs", "flexsp.plan", "flexsp.runtime")),
    "flexsp.checkpoint": ("checkpoints of model, optimizer, loader and RNG state",
                          ("flexsp.errors", "flexsp.inputs", "flexsp.plan", "flexsp.runtime")),
    "flexsp.profile": ("fit a cost model to real hardware",
                       ("flexsp.errors", "flexsp.inputs", "flexsp.plan", "flexsp.runtime", "flexsp.hf")),
    "flexsp.replay": ("replay a plan on one device against its prediction",
                      ("flexsp.errors", "flexsp.inputs", "flexsp.plan", "flexsp.evaluation", "flexsp.runtime",
                       "flexsp.hf", "flexsp.profile")),
    "flexsp.telemetry": ("per-step records measured against the plan, online cost-model refit, run reports",
                         ("flexsp.errors", "flexsp.inputs", "flexsp.plan", "flexsp.runtime")),
    "flexsp.cli": ("the command line", ("flexsp.errors", "flexsp.inputs", "flexsp.plan",
                                         "flexsp.evaluation", "flexsp.profile", "flexsp.replay", "flexsp.telemetry")),
    "flexsp.__main__": ("python -m flexsp", ("flexsp.cli",)),
    "flexsp": ("the public front door: Cluster, CostModel, plan_batch, Plan, PlanConfig",
               ("flexsp.errors", "flexsp.plan")),
}
TORCH_FREE = ("solver", "flexsp.errors", "flexsp.inputs", "flexsp.plan", "flexsp.evaluation", "flexsp")
TORCH_ON_USE = ("flexsp.checkpoint", "flexsp.profile", "flexsp.replay", "flexsp.telemetry", "flexsp.cli",
                "flexsp.__main__")   # lazily


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted([*ROOT.glob("flexsp/**/*.py"), *ROOT.glob("solver/**/*.py")]):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Project modules ``name`` imports anywhere in its source (``from pkg import mod`` counts ``pkg.mod``)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:      # `import a.b.c` where only a.b is a module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports(name, path, known) for name, path in mods.items()}


def layer_of(module: str) -> str:
    best = max((layer for layer in LAYERS if module == layer or module.startswith(layer + ".")), key=len,
               default=None)
    if best is None:
        raise KeyError(f"module {module} belongs to no layer of tests/layering.py; add it to LAYERS")
    return best


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def markdown_table() -> str:
    rows = ["| layer | holds | torch | may import |", "|---|---|---|---|"]
    for layer, (holds, allowed) in LAYERS.items():
        torch = "never" if layer in TORCH_FREE else "on first use" if layer in TORCH_ON_USE else "at import"
        rows.append(f"| `{layer}` | {holds} | {torch} | {', '.join(f'`{a}`' for a in allowed) or 'nothing of the project'} |")
    return "\n".join(rows)
