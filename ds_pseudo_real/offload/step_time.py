"""The modelled time of an optimizer step with granular offload, per way of running the host step, and whether a
node's host memory holds its ranks' plans: plain functions over an ``OffloadPlan``.

Owns: the step-time model (device compute from an assumed rate, the plan's copies and host Adam at the setup's
rates) in three modes, and the node check. Must not import torch, DeepSpeed or Megatron, nor measure anything
(``offload.calibrate`` measures the rates; the plan command hands them in through the setup).

Per optimizer step of GA micro-batches, on one rank:
  compute: a micro-batch's forward is 2 x P x T FLOPs (P: the parameters a token meets on this rank, for an MoE
      layer its dense part and the experts it is routed to; T: tokens of the micro-batch), its backward twice that,
      plus the forward again under activation checkpointing, at ``flops_per_s``.
  a group's host work: its fetches (host_params: params in for every forward and backward, half each), then after
      its backward its gradient out, its host Adam, then (host_optimizer) its master in; the bytes add up to the
      plan's ``moved_bytes_per_step`` and the elements to its ``host_stepped_numel``.
  a micro-batch's forward takes f = max(F, its fetches in / PCIe), its backward b = max(B, its fetches in / PCIe)
      (prefetched, hidden when the compute is longer); the last micro-batch's backward starts at
      s = GA x f + (GA - 1) x b and ends at e = s + b. The host work is a chain over the groups, three resources
      each taken in turn (PCIe out, the host's cores, PCIe in; PCIe is full duplex), group g ready at r_g:
          out_g = max(out_prev, r_g) + gradient_g / PCIe
          cpu_g = max(cpu_prev, out_g) + host_numel_g / host Adam rate
          in_g  = max(in_prev, cpu_g) + master_g / PCIe
  ``sequential`` (host_step "sequential"): every group ready at e, the offload's own groups (below) first:
      step = e + the chain from 0.
  ``overlapped`` (host_step "overlapped"): the groups the offload steps during the backward (host_params outside
      DeepSpeed's optimizer with streamed gradients: ZeRO 1/2) first, in backward order, each ready when the
      backward passes its layer, r_i = s + (L - i) / L x b; then the others (DeepSpeed's groups: host_optimizer,
      host_params at ZeRO 0) ready at e. step = max(e, the chain's end). Never more than ``sequential``, never less
      than the backward. The copies in do not wait for the backward's fetches, which share their direction.
  ``delayed`` (host_step "delayed", ZeRO-Offload's delayed parameter update): the groups above stream their
      gradients out during the backward (ready r_i, as ``overlapped``), into a second buffer, while the host steps
      the gradients of the step before (ready at 0, waiting for no copy out): for such a group
          out_g = max(out_prev, r_g) + gradient_g / PCIe
          cpu_g = cpu_prev + host_numel_g / host Adam rate
      the others (DeepSpeed's groups) after the backward as in ``sequential``, their chain starting at its end, while
      the late host step goes on: the host's cores shared between the two, the others' host Adam is slowed by the
      time it overlaps the late one's rest R = max(0, W_late - its start), by at most its own length W_others, and
      the host Adam ends at W_late + W_others if they overlap. step = max(e, the copies out's end, the others'
      chain end + min(R, W_others), the host Adam's end). In a steady run the late host step fills step t + 1.
  ``OffloadPlan.offload_seconds_per_step`` stays what it was: every transfer and the host Adam added, an upper
  bound to compare plans with.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Mapping, NamedTuple, Optional

from ds_pseudo_real.offload.planner import OffloadPlan, PlacementLevel, format_bytes, host_numel_stepped

GIB = 2**30

# Default device rate: a V100-SXM2's fp16 tensor-core peak (125 TFLOPS) at 25 % achieved, as MoE training with its
# all-to-alls reaches on it; an assumption, printed as one (``ds-pseudo-real plan --gpu-tflops``).
DEFAULT_DEVICE_FLOPS = 125e12 * 0.25
# Host memory of a node that the ranks' plans cannot have: the OS and its page cache (the data files), and per rank
# the process itself (torch's and CUDA's libraries and host-side context, DeepSpeed's buffers, data-loader workers).
NODE_RESERVE_BYTES = 16 * GIB
PROCESS_HOST_BYTES = 4 * GIB


@dataclass(frozen=True)
class Compute:
    """The device's work on one micro-batch on one rank."""

    active_params: int  # parameters a token meets on this rank (MoE: dense + the experts it is routed to)
    tokens: int  # tokens of one micro-batch on this rank
    flops_per_s: float
    recompute: bool = False  # activation checkpointing: the backward runs the forward again

    @property
    def forward_seconds(self) -> float:
        return 2 * self.active_params * self.tokens / self.flops_per_s

    @property
    def backward_seconds(self) -> float:
        return (3 if self.recompute else 2) * self.forward_seconds


NO_COMPUTE = Compute(0, 0, 1.0)


class GroupWork(NamedTuple):
    """One offloaded group's host work per optimizer step."""

    name: str
    position: Optional[int]  # the layer whose backward completes its gradient; None: after the whole backward
    fetch_bytes: int  # params in, for every micro-batch's forward and backward (half each)
    gradient_bytes: int  # out, after its backward
    master_bytes: int  # in, after its host Adam
    host_numel: int
    during_backward: bool  # stepped during the backward by host_step "overlapped"


class StepTimes(NamedTuple):
    """Modelled seconds of one optimizer step (``forward``, ``backward``: all micro-batches', with the fetches)."""

    forward: float
    backward: float
    sequential: float
    overlapped: float
    delayed: float

    @property
    def overlapped_ratio(self) -> float:
        return self.overlapped / self.sequential if self.sequential else 1.0


def group_work(plan: OffloadPlan) -> List[GroupWork]:
    """The offloaded groups' host work in backward order (later layers first, ``other`` last)."""
    setup = plan.setup
    work = []
    for p in plan.placements:
        if p.level is PlacementLevel.DEVICE:
            continue
        fetch = 0
        if p.level is PlacementLevel.HOST_PARAMS:
            fetch = 2 * setup.gradient_accumulation_steps * p.group.uses * p.group.numel * setup.working_bytes
        master = p.bytes.moved_per_step // 2 if p.level is PlacementLevel.HOST_OPTIMIZER else 0
        numel = host_numel_stepped(p.group.numel, p.level, setup, p.group.dp_size)
        during = p.level is PlacementLevel.HOST_PARAMS and setup.streams_gradients
        work.append(GroupWork(p.group.name, p.group.index if p.group.is_layer else None, fetch,
                              p.bytes.moved_per_step - fetch - master, master, numel, during))
    return sorted(work, key=lambda w: -1 if w.position is None else w.position, reverse=True)


def host_chain_end(work: Iterable[GroupWork], ready: Iterable[float], pcie_bytes_per_s: float,
                   adam_params_per_s: float, late: bool = False) -> float:
    """When the last of the groups' gradient out, host Adam and master in ends, each group starting at its ready
    time, the three resources taken in the groups' order (the module docstring's recurrence). ``late``: the groups
    step the gradients of the step before, so their host Adam waits for no copy out."""
    out = cpu = back = 0.0
    for w, r in zip(work, ready):
        out = max(out, r) + w.gradient_bytes / pcie_bytes_per_s
        cpu = (cpu if late else max(cpu, out)) + w.host_numel / adam_params_per_s
        back = max(back, cpu) + w.master_bytes / pcie_bytes_per_s
    return max(out, cpu, back)


def step_times(plan: OffloadPlan, compute: Compute = NO_COMPUTE) -> StepTimes:
    """The step in each mode (module docstring) for ``plan`` at its setup's rates, ``compute`` per micro-batch."""
    setup = plan.setup
    ga, pcie, adam = setup.gradient_accumulation_steps, setup.pcie_bytes_per_s, setup.cpu_adam_params_per_s
    work = group_work(plan)
    fetch_each_way = sum(w.fetch_bytes for w in work) / (2 * ga) / pcie  # one micro-batch's forward (or backward)
    f = max(compute.forward_seconds, fetch_each_way)
    b = max(compute.backward_seconds, fetch_each_way)
    start = ga * f + (ga - 1) * b
    end = start + b
    # the offload steps its own groups first, then DeepSpeed's (``GranularOffloadOptimizer.step``)
    ordered = [w for w in work if w.during_backward] + [w for w in work if not w.during_backward]
    sequential = end + host_chain_end(ordered, [0.0] * len(work), pcie, adam)
    layers = max((p.group.index + p.group.uses for p in plan.placements if p.group.is_layer), default=1)
    ready = [start + b * (layers - w.position) / layers if w.during_backward and w.position is not None else end
             for w in ordered]
    overlapped = max(end, host_chain_end(ordered, ready, pcie, adam))
    delayed = _delayed(ordered, ready, end, pcie, adam)
    return StepTimes(ga * f, ga * b, sequential, overlapped, delayed)


def _delayed(ordered: List[GroupWork], ready: List[float], end: float, pcie: float, adam: float) -> float:
    """The delayed step (module docstring): the offload's own groups stepped late from 0, DeepSpeed's after ``end``
    beside them."""
    late = [w for w in ordered if w.during_backward]
    others = [w for w in ordered if not w.during_backward]
    late_end = host_chain_end(late, ready[:len(late)], pcie, adam, late=True)
    w_late = sum(w.host_numel for w in late) / adam
    w_others = sum(w.host_numel for w in others) / adam
    if not others:
        return max(end, late_end)
    outs = 0.0  # when the late groups' gradients are out: the others' copies out follow
    for w, r in zip(late, ready):
        outs = max(outs, r) + w.gradient_bytes / pcie
    others_alone = host_chain_end(others, [max(end, outs)] + [end] * (len(others) - 1), pcie, adam)
    first_adam = max(end, outs) + others[0].gradient_bytes / pcie
    rest = max(0.0, w_late - first_adam)
    adam_end = w_late + w_others if rest > 0 else max(w_late, others_alone)
    return max(end, late_end, others_alone + min(rest, w_others), adam_end)


def describe_step_times(times: StepTimes, plan: OffloadPlan, compute: Compute, sources: Mapping[str, str]) -> str:
    """Two lines: the rates and what each rests on (``sources``: "measured ..." or "assumed ..." per rate name
    ``host_adam``, ``pcie``, ``device``), and the step per mode."""
    s = plan.setup
    if compute.tokens:
        device = (f"device {compute.flops_per_s / 1e12:.4g} TFLOPS ({sources['device']}; {compute.active_params:,} "
                  f"parameters a token meets x {compute.tokens:,} tokens a micro-batch"
                  + (", the forward recomputed in the backward" if compute.recompute else "") + ")")
    else:
        device = "device compute not modelled (no tokens per micro-batch: give granular_offload.activations)"
    return "\n".join([
        f"rates: host Adam {s.cpu_adam_params_per_s:.3g} params/s ({sources['host_adam']}), PCIe "
        f"{s.pcie_bytes_per_s / 1e9:.3g} GB/s ({sources['pcie']}), {device}",
        f"modelled step: forward {times.forward:.3g} s, backward {times.backward:.3g} s; host_step sequential (the "
        f"host step after the backward) {times.sequential:.3g} s, overlapped (host_params layers stepped during the "
        f"backward) {times.overlapped:.3g} s = {times.overlapped_ratio:.2f} x sequential, delayed (stepped one step "
        f"late, during the next forward and backward) {times.delayed:.3g} s",
    ])


class NodeFit(NamedTuple):
    """The host memory ``ranks`` ranks' plans need on one node against the node's."""

    ranks: int
    plan_bytes: int  # one rank's plan: its host memory (pinned: whole pages)
    node_bytes: int
    reserve_bytes: int = NODE_RESERVE_BYTES
    process_bytes: int = PROCESS_HOST_BYTES

    def needed(self, ranks: Optional[int] = None) -> int:
        ranks = self.ranks if ranks is None else ranks
        return ranks * (self.plan_bytes + self.process_bytes) + self.reserve_bytes

    @property
    def fits(self) -> bool:
        return self.needed() <= self.node_bytes

    @property
    def most_ranks(self) -> int:
        """The most ranks per node whose plans fit (0: not even one)."""
        return max(0, (self.node_bytes - self.reserve_bytes) // (self.plan_bytes + self.process_bytes))


def describe_node_fit(fit: NodeFit, name: str = "node") -> str:
    """One line: fits, or not and what would."""
    head = (f"{name}: {fit.ranks} rank{'s' if fit.ranks != 1 else ''} x ({format_bytes(fit.plan_bytes)} plan + {format_bytes(fit.process_bytes)} "
            f"process) + {format_bytes(fit.reserve_bytes)} reserve = {format_bytes(fit.needed())} of host memory, ")
    if fit.fits:
        return head + f"within the node's {format_bytes(fit.node_bytes)}: fits"
    most = fit.most_ranks
    instead = (f"at most {most} rank{'s' if most != 1 else ''} per node fit{'' if most != 1 else 's'} "
               f"({format_bytes(fit.needed(most))})" if most else "not even one rank fits")
    return (head + f"above the node's {format_bytes(fit.node_bytes)}: does not fit; {instead}, or put the optimizer "
            f"state on NVMe with DeepSpeed's ZeRO-3 NVMe tier (zero_optimization.offload_optimizer device nvme, "
            f"which the delink supports; granular offload places nothing on NVMe)")
