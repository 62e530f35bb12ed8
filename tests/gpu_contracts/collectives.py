"""Every collective of ``torch.distributed`` or ``deepspeed.comm`` that the project's code calls, found in its syntax
tree, and the test that drives it under the fake NCCL (``DRIVEN_BY``); a call that never sees a device tensor says
why on its line or the line above, in a comment beginning ``gloo-only:``.

A call is named ``path:function:collective``, with ``#2``, ``#3`` for the second and third call of that collective
in that function. The fixture in ``conftest.py`` checks, after each test named here, that the fake NCCL saw a
collective issued from the line of every call the test is named for (``FakeNccl.sites``);
``test_collective_inventory.py`` checks that the table names every call and nothing else."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("ds_pseudo_real", "megatron_patches", "launch", "benchmarks")
MODULES = {"torch.distributed", "torch.distributed.distributed_c10d", "deepspeed.comm", "deepspeed.comm.comm"}
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "all_gather_coalesced",
    "all_reduce_coalesced", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier", "broadcast",
    "broadcast_object_list", "gather", "gather_object", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter",
    "scatter_object_list", "send", "recv", "isend", "irecv", "batch_isend_irecv", "inference_all_reduce",
}
GLOO_ONLY = "gloo-only:"

NCCL_TESTS = "test_nccl_collectives.py::"
PATHS = "test_paths.py::"
DRIVEN_BY: Dict[str, str] = {
    "ds_pseudo_real/ranks.py:gather:all_gather_object":
        NCCL_TESTS + "test_the_delinks_object_gathers_and_barriers_use_the_ranks_gpu",
    "ds_pseudo_real/ranks.py:barrier:barrier":
        NCCL_TESTS + "test_the_delinks_object_gathers_and_barriers_use_the_ranks_gpu",
    "ds_pseudo_real/ds_state/pipeline.py:total_parameter_numel:all_reduce":
        PATHS + "test_a_pipeline_with_granular_offload_runs_on_the_ranks_gpu",
    "ds_pseudo_real/offload/__init__.py:_refuse_own_steps_of_tied_across_stages:all_reduce":
        PATHS + "test_a_pipeline_with_granular_offload_runs_on_the_ranks_gpu",
    "ds_pseudo_real/offload/gradients.py:OwnGradients._reduced:all_reduce":
        NCCL_TESTS + "test_own_gradients_are_reduced_and_their_norm_taken_on_the_device",
    "ds_pseudo_real/offload/gradients.py:OwnGradients.norm:all_reduce":
        NCCL_TESTS + "test_own_gradients_are_reduced_and_their_norm_taken_on_the_device",
    "ds_pseudo_real/offload/gradients.py:OwnGradients.norm:all_reduce#2":
        PATHS + "test_a_pipeline_with_granular_offload_runs_on_the_ranks_gpu",
    "megatron_patches/delink.py:_AdamState.read:all_reduce":
        PATHS + "test_the_megatron_drop_ins_delink_runs_on_the_ranks_gpu[distributed_optimizer]",
    "megatron_patches/delink.py:_AdamState.read:all_reduce#2":
        PATHS + "test_the_megatron_drop_ins_delink_runs_on_the_ranks_gpu[distributed_optimizer]",
    "megatron_patches/stage_copies.py:connect:all_gather_object":
        NCCL_TESTS + "test_megatron_stage_copies_are_synced_and_summed_on_the_device",
    "megatron_patches/stage_copies.py:connect:all_reduce":
        NCCL_TESTS + "test_megatron_stage_copies_are_synced_and_summed_on_the_device",
    "megatron_patches/stage_copies.py:reduce_gradients:all_reduce":
        NCCL_TESTS + "test_megatron_stage_copies_are_synced_and_summed_on_the_device",
    "megatron_patches/run.py:total_parameter_numel:all_reduce":
        PATHS + "test_the_megatron_drop_ins_delink_runs_on_the_ranks_gpu",
    "launch/trainer.py:sum_over_ranks:all_reduce": PATHS + "test_the_main_jobs_loop_runs_on_the_ranks_gpu[zero1]",
}


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of a collective: its name (see the module's docstring), file, line, and whether a ``gloo-only:``
    comment stands on its line or the line above."""

    name: str
    path: str
    line: int
    gloo_only: bool


def _aliases(tree: ast.AST) -> Dict[str, str]:
    """Names a module binds to the distributed modules (``dist``, ``comm``, ``c10d``) or to their collectives
    themselves (``from torch.distributed import all_reduce``): name -> what it stands for."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES:
                    aliases[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in MODULES or (node.module in MODULES and alias.name in COLLECTIVES):
                    aliases[alias.asname or alias.name] = full
    return aliases


class _Finder(ast.NodeVisitor):
    def __init__(self, path: str, source: List[str], aliases: Dict[str, str]):
        self.path, self.source, self.aliases = path, source, aliases
        self.scope: List[str] = []
        self.calls: List[Call] = []
        self.counts: Dict[str, int] = {}

    def _scoped(self, node):
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def visit_Call(self, node: ast.Call):
        collective = None
        if isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES:
            receiver = ast.unparse(node.func.value)
            if self.aliases.get(receiver, receiver) in MODULES:
                collective = node.func.attr
        elif isinstance(node.func, ast.Name) and self.aliases.get(node.func.id, "").rpartition(".")[2] in COLLECTIVES:
            collective = self.aliases[node.func.id].rpartition(".")[2]
        if collective is not None:
            name = f"{self.path}:{'.'.join(self.scope) or '<module>'}:{collective}"
            self.counts[name] = self.counts.get(name, 0) + 1
            if self.counts[name] > 1:
                name += f"#{self.counts[name]}"
            lines = self.source[max(node.lineno - 2, 0):node.end_lineno]
            self.calls.append(Call(name, self.path, node.lineno, any(GLOO_ONLY in line for line in lines)))
        self.generic_visit(node)


def find_calls() -> List[Call]:
    """Every call of a collective in the project's code (``ROOTS``), in file and line order."""
    calls = []
    for root in ROOTS:
        for file in sorted((REPO / root).rglob("*.py")):
            text = file.read_text()
            tree = ast.parse(text)
            finder = _Finder(str(file.relative_to(REPO)), text.splitlines(), _aliases(tree))
            finder.visit(tree)
            calls += finder.calls
    return calls


def calls_driven_by(test: str) -> List[Call]:
    """The calls ``DRIVEN_BY`` names ``test`` for (``file.py::name[params]``; a name without parameters stands for
    every parametrization)."""
    names = {name for name, by in DRIVEN_BY.items() if by == test or by == test.split("[")[0]}
    return [call for call in find_calls() if call.name in names]
