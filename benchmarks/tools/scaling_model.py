"""Step time of a training run vs the number of nodes, on paper: compute, collective volumes, link bandwidths.

    python benchmarks/tools/scaling_model.py [--model qwen3-8b ...] [--nodes 1 2 4 ...] [--ib-gbs 50] ...

A planning tool beside the benchmarks, not part of the package: nothing in surojax uses it (tests/bench holds its
checks; it imports surojax from the repository root).

No device work: arithmetic over the repository's model shapes (surojax/bench/shapes.py), FLOPs per token as
surojax/bench/flops.py counts them (`mode="full"`: full fine-tuning / pretraining), and the collectives that the
sharding rules (surojax/parallel/rules.py) and expert parallelism (surojax/parallel/expert.py) imply. The formulas,
the defaults and where each default comes from are written out in docs/multi_gpu.md. UNCALIBRATED: no multi-GPU
measurement exists yet; docs/multi_gpu.md says which measurement calibrates which input, and
benchmarks/tools/scaling_calibration.py fits mfu and overlap from benchmarks/campaigns/multi_gpu_h200.py's rows.

Model, per GPU and per optimizer step (one micro-batch: gradient accumulation would repeat the fsdp gathers):

    compute   = tokens_per_gpu * FLOPs/token / (peak * mfu) / (1 - bubble),  bubble = (S-1)/(M*R + S-1)
    comm      = sum over mesh axes of bytes_received(axis) / bandwidth(axis)   (NVLink when the axis' groups stay
                in one node, InfiniBand when they cross nodes; collectives of different axes do not run at once)
    step      = compute + exposed + hidden - min(overlap * hidden, compute)
                hidden: parameter / gradient collectives (fsdp, data, the expert axis' dense-gradient all-reduce,
                pipeline sends), which XLA's latency-hiding scheduler can run under the layers' compute;
                exposed: activation collectives on the layer's critical path (tensor all-reduces, the expert token
                exchange)

Placement: the mesh's axes are laid out outermost to innermost as AXIS_ORDER, the innermost on consecutive GPUs of
one node (`jax.make_mesh` sorts GPU devices by global id, node by node, and reshapes them row-major), so an axis
crosses nodes exactly when its size times the sizes of the axes inside it exceeds the GPUs of a node.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: surojax
from surojax.bench.flops import PEAK_BF16_FLOPS, step_flops
from surojax.bench.shapes import SHAPES, model_config
from surojax.models.config import ModelConfig

# Outermost first. `stage` outermost: its traffic (point-to-point activations) is the smallest, so it is the
# axis to put across nodes (it is MESH_AXES' outermost axis, surojax/parallel/mesh.py).
AXIS_ORDER: tuple[str, ...] = ("stage", "data", "fsdp", "expert", "tensor")
MODELS: tuple[str, ...] = ("qwen3-8b", "llama3-70b", "qwen3-30b-a3b")
NODES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
# Sustained fraction of the 731 TFLOP/s bf16 ceiling, measured on one H200 (benchmarks/RESULTS.md): dense, the
# Qwen3-8B LoRA step at 71.0% MFU (session 4, the largest dense shape measured); MoE, the Qwen3-30B-A3B LoRA step
# at 26.6% (session 6, house FLOP count: the work actually done).
DEFAULT_MFU = {"dense": 0.71, "moe": 0.266}
STATE_BYTES = {"master": 4, "grads": 4, "adam": 8}  # per parameter: fp32 master, fp32 gradients, AdamW m and v


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One GPU and its links. Bandwidths: bytes/s per GPU per direction that a collective achieves (bus bandwidth
    in nccl-tests' terms); defaults are the H200 SXM node's nominal links: NVLink 4 at 450 GB/s per direction, one
    400 Gb/s InfiniBand NIC per GPU (50 GB/s)."""

    gpus_per_node: int = 8
    peak_flops: float = PEAK_BF16_FLOPS
    nvlink_bytes_s: float = 450e9
    ib_bytes_s: float = 50e9
    hbm_bytes: float = 143_771 * 2**20  # the H200 of benchmarks/RESULTS.md


@dataclasses.dataclass(frozen=True)
class Workload:
    """What one step runs. `tokens_per_gpu` is fixed as nodes grow (weak scaling: the global batch grows); a batch
    shard (one coordinate of data x fsdp x expert) holds tokens_per_gpu * tensor * stage tokens, since the tensor
    and stage devices of a shard share its rows. Bytes: the dtype fsdp gathers parameters in (bf16 compute copy),
    of gradients (fp32, the gradients of fp32 master weights) and of activations (bf16)."""

    seq_len: int = 4096
    tokens_per_gpu: int = 16384
    param_bytes: int = 2
    grad_bytes: int = 4
    act_bytes: int = 2
    mfu: float | None = None  # None: DEFAULT_MFU of the model's kind
    overlap: float = 0.8  # fraction of the hideable collectives that compute hides (capped by the compute time)


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """Axis sizes; `microbatches` M and `repeats` R (circular schedule) matter only with stage > 1. `zero_stage`
    (1 or 2) shards the optimizer state (and, at 2, the gradients) over `data` too: memory only, the bytes moved
    are those of an all-reduce either way (reduce-scatter + all-gather)."""

    data: int = 1
    fsdp: int = 1
    expert: int = 1
    tensor: int = 1
    stage: int = 1
    microbatches: int = 1
    repeats: int = 1
    zero_stage: int = 1

    @property
    def devices(self) -> int:
        return self.data * self.fsdp * self.expert * self.tensor * self.stage

    def size(self, axis: str) -> int:
        return getattr(self, axis)

    def label(self) -> str:
        parts = [f"{a[0] if a != 'stage' else 'pp'}{self.size(a)}" for a in AXIS_ORDER if self.size(a) > 1]
        if self.stage > 1:
            parts.append(f"M{self.microbatches}R{self.repeats}")
        return " ".join(parts) or "1"


def crosses_nodes(plan: MeshPlan, axis: str, gpus_per_node: int) -> bool:
    """Whether the groups of `axis` span several nodes (AXIS_ORDER placement, innermost axis on one node)."""
    inner = math.prod(plan.size(a) for a in AXIS_ORDER[AXIS_ORDER.index(axis) + 1:])
    return plan.size(axis) > 1 and inner * plan.size(axis) > gpus_per_node


# Ring collectives (NCCL's large-message algorithm): bytes one GPU receives, for an array of `total` bytes
# (all-gather: the gathered array; reduce-scatter / all-reduce: the array being reduced) over n GPUs.
def all_gather_bytes(total: float, n: int) -> float:
    return (n - 1) / n * total


def reduce_scatter_bytes(total: float, n: int) -> float:
    return (n - 1) / n * total


def all_reduce_bytes(total: float, n: int) -> float:
    return 2 * (n - 1) / n * total


def expert_params(cfg: ModelConfig) -> int:
    """Parameters of all experts of all layers (0 for a dense model): the arrays the `expert` axis splits."""
    return 0 if cfg.moe is None else cfg.num_layers * cfg.moe.num_experts * cfg.moe.expert_params(cfg.hidden_size)


def bubble_fraction(plan: MeshPlan) -> float:
    """Idle fraction of a circular pipeline schedule: (S-1) / (M*R + S-1); 0 without stages."""
    S = plan.stage
    return (S - 1) / (plan.microbatches * plan.repeats + S - 1)


def comm_bytes(cfg: ModelConfig, plan: MeshPlan, work: Workload) -> dict[str, dict[str, float]]:
    """Bytes one GPU receives per step, per mesh axis: {axis: {"hidden": bytes, "exposed": bytes}}.

    fsdp    all-gather the parameter shard's params in the forward and again in the backward (the layer scan keeps
            no gathered weights), reduce-scatter its gradients
    data    all-reduce the gradients left after the fsdp reduce-scatter
    expert  all-reduce the dense (non-expert) gradients, replicated over `expert`; per MoE layer the token exchange
            of surojax/parallel/expert.py, forward and backward: all-gather of bf16 tokens + reduce-scatter of
            fp32 partial outputs, (e-1) * X * D each, X the shard's tokens
    tensor  per layer two all-reduces of [X, D] activations forward and two backward (Megatron), plus the
            vocabulary-parallel embedding and lm_head (one each way)
    stage   every micro-batch's activations sent forward and gradients sent back, once per repeat
    """
    d, f, e, t, s = plan.data, plan.fsdp, plan.expert, plan.tensor, plan.stage
    P_e = expert_params(cfg)
    P_d = cfg.num_params() - P_e
    shard = P_d / (t * s) + P_e / (t * s * e)  # parameters one fsdp group splits
    tokens = work.tokens_per_gpu * t * s  # X: the batch shard's tokens, which every layer of this GPU sees
    D, layers = cfg.hidden_size, cfg.num_layers / s
    out = {a: {"hidden": 0.0, "exposed": 0.0} for a in AXIS_ORDER}
    if f > 1:
        out["fsdp"]["hidden"] = 2 * all_gather_bytes(shard * work.param_bytes, f) \
            + reduce_scatter_bytes(shard * work.grad_bytes, f)
    if d > 1:
        out["data"]["hidden"] = all_reduce_bytes(shard / f * work.grad_bytes, d)
    if e > 1:
        out["expert"]["hidden"] = all_reduce_bytes(P_d / (t * s * f) * work.grad_bytes, e)
        if cfg.moe is not None:
            per_layer = (e - 1) * tokens * D * (work.act_bytes + 4)  # all_gather bf16 + psum_scatter fp32
            out["expert"]["exposed"] = 2 * layers * per_layer
    if t > 1:
        out["tensor"]["exposed"] = (4 * layers + 2) * all_reduce_bytes(tokens * D * work.act_bytes, t)
    if s > 1:
        out["stage"]["hidden"] = 2 * plan.repeats * tokens * D * work.act_bytes
    return out


def state_bytes_per_gpu(cfg: ModelConfig, plan: MeshPlan) -> float:
    """fp32 master + fp32 gradients + AdamW state per GPU, split as the rules split parameters (fsdp x tensor x
    stage, x expert for expert weights), the optimizer state (zero_stage >= 1) and gradients (>= 2) over data too.
    Activations are not counted."""
    P_e = expert_params(cfg)
    params = (cfg.num_params() - P_e) / (plan.fsdp * plan.tensor * plan.stage) + P_e / (
        plan.fsdp * plan.tensor * plan.stage * plan.expert)
    grads = STATE_BYTES["grads"] / (plan.data if plan.zero_stage >= 2 else 1)
    adam = STATE_BYTES["adam"] / (plan.data if plan.zero_stage >= 1 else 1)
    return params * (STATE_BYTES["master"] + grads + adam)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (surojax/bench/flops.py, mode full: 6 x active matmul params + causal attention),
    one segment of `seq_len` per row."""
    return step_flops(cfg, mode="full", tokens=seq_len, segment_lengths=[seq_len])["per_token"]


@dataclasses.dataclass(frozen=True)
class Prediction:
    nodes: int
    plan: MeshPlan
    state_gib: float
    fits: bool
    compute_s: float  # with the pipeline bubble
    comm_intra_s: float
    comm_inter_s: float
    step_s: float
    tokens_per_s: float  # global
    efficiency: float  # compute-bound step / step: the fraction of the single-GPU compute rate kept per GPU
    hidden_s: float = 0.0  # collectives compute may hide (before overlap), NVLink and IB together
    exposed_s: float = 0.0  # collectives on the critical path


def predict(cfg: ModelConfig, plan: MeshPlan, nodes: int, hw: Hardware = Hardware(),
            work: Workload = Workload()) -> Prediction:
    if plan.devices != nodes * hw.gpus_per_node:
        raise ValueError(f"mesh {plan.label()} has {plan.devices} devices, {nodes} nodes have "
                         f"{nodes * hw.gpus_per_node}")
    mfu = work.mfu if work.mfu is not None else DEFAULT_MFU["moe" if cfg.moe is not None else "dense"]
    ideal = work.tokens_per_gpu * flops_per_token(cfg, work.seq_len) / (hw.peak_flops * mfu)
    compute = ideal / (1 - bubble_fraction(plan))
    times = {"intra": 0.0, "inter": 0.0}
    hidden = exposed = 0.0
    for axis, parts in comm_bytes(cfg, plan, work).items():
        inter = crosses_nodes(plan, axis, hw.gpus_per_node)
        bw = hw.ib_bytes_s if inter else hw.nvlink_bytes_s
        times["inter" if inter else "intra"] += (parts["hidden"] + parts["exposed"]) / bw
        hidden += parts["hidden"] / bw
        exposed += parts["exposed"] / bw
    step = compute + exposed + hidden - min(work.overlap * hidden, compute)
    state = state_bytes_per_gpu(cfg, plan)
    return Prediction(nodes=nodes, plan=plan, state_gib=state / 2**30, fits=state <= 0.6 * hw.hbm_bytes,
                      compute_s=compute, comm_intra_s=times["intra"], comm_inter_s=times["inter"], step_s=step,
                      tokens_per_s=plan.devices * work.tokens_per_gpu / step, efficiency=ideal / step,
                      hidden_s=hidden, exposed_s=exposed)


def default_plan(cfg: ModelConfig, nodes: int, hw: Hardware = Hardware(), work: Workload = Workload()) -> MeshPlan:
    """The rule of docs/multi_gpu.md: fsdp over the GPUs of a node (NVLink carries the per-layer gathers); if the
    training state then exceeds 60% of a GPU's memory, pipeline stages across nodes, the fewest (a power of 2) that
    fit; data parallelism across the remaining nodes. Stages get M = the shard's rows micro-batches and R = 2
    repeats when the layers per stage allow it. A model that cannot fit in `nodes` keeps the largest stage count
    possible (its prediction says fits=False)."""
    g = hw.gpus_per_node
    stage = 1
    while stage < nodes and not _fits(cfg, MeshPlan(fsdp=g, stage=stage), hw):
        stage *= 2
    if nodes % stage:
        raise ValueError(f"{nodes} nodes do not split into {stage} pipeline stages")
    if stage == 1:
        return MeshPlan(data=nodes, fsdp=g)
    rows = work.tokens_per_gpu * stage // work.seq_len
    repeats = 2 if cfg.num_layers % (2 * stage) == 0 else 1
    return MeshPlan(data=nodes // stage, fsdp=g, stage=stage, microbatches=max(rows, 1), repeats=repeats)


def _fits(cfg: ModelConfig, plan: MeshPlan, hw: Hardware) -> bool:
    return state_bytes_per_gpu(cfg, plan) <= 0.6 * hw.hbm_bytes


def parse_mesh(text: str, devices: int) -> MeshPlan:
    """`data=-1,fsdp=8,stage=2,microbatches=8,repeats=2` -> MeshPlan; one axis may be -1 (the rest)."""
    fields = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = item.partition("=")
        if key not in {f.name for f in dataclasses.fields(MeshPlan)}:
            raise ValueError(f"--mesh: unknown key {key!r}; expected axes {', '.join(AXIS_ORDER)} or "
                             f"microbatches, repeats, zero_stage")
        fields[key] = int(value)
    rest = [a for a in AXIS_ORDER if fields.get(a) == -1]
    if len(rest) > 1:
        raise ValueError(f"--mesh: at most one axis may be -1, got {', '.join(rest)}")
    if rest:
        fixed = math.prod(fields.get(a, 1) for a in AXIS_ORDER if a != rest[0])
        if devices % fixed:
            raise ValueError(f"--mesh: {fixed} does not divide {devices} devices")
        fields[rest[0]] = devices // fixed
    return MeshPlan(**fields)


HEADER = (f"{'nodes':>5}  {'mesh':<24} {'state GiB':>9} {'compute s':>9} {'intra s':>8} {'inter s':>8} "
          f"{'step s':>7} {'tokens/s':>11} {'eff':>5} {'vs 1st':>6}")


def format_table(name: str, preds: Sequence[Prediction], label: str = "uncalibrated") -> str:
    lines = [f"{name} ({label}; eff = compute-bound step / step; vs 1st = eff / eff of the first row that fits; "
             f"! = training state over 60% of a GPU)", HEADER]
    base = next((p for p in preds if p.fits), None)
    for p in preds:
        rel = f"{p.efficiency / base.efficiency:6.2f}" if p.fits else "     -"
        state = f"{p.state_gib:9.1f}" if p.fits else f"{p.state_gib:7.1f} !"
        lines.append(f"{p.nodes:>5}  {p.plan.label():<24} {state} {p.compute_s:9.3f} {p.comm_intra_s:8.3f} "
                     f"{p.comm_inter_s:8.3f} {p.step_s:7.3f} {p.tokens_per_s:11,.0f} {p.efficiency:5.2f} {rel}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/tools/scaling_model.py", description=__doc__.split("\n")[0])
    ap.add_argument("--model", action="append", choices=sorted(SHAPES), help=f"default: {', '.join(MODELS)}")
    ap.add_argument("--nodes", type=int, nargs="+", default=list(NODES))
    ap.add_argument("--mesh", help="axis sizes for every node count, e.g. data=-1,tensor=8 (default: the rule)")
    add_hardware_args(ap)
    ap.add_argument("--mfu", type=float, help=f"sustained fraction of the peak (default {DEFAULT_MFU})")
    ap.add_argument("--overlap", type=float, default=Workload.overlap)
    ap.add_argument("--seq", type=int, default=Workload.seq_len)
    ap.add_argument("--tokens-per-gpu", type=int, default=Workload.tokens_per_gpu)
    args = ap.parse_args(argv)
    hw = hardware(args)
    work = Workload(seq_len=args.seq, tokens_per_gpu=args.tokens_per_gpu, mfu=args.mfu, overlap=args.overlap)
    print(tables(args.model or MODELS, args.nodes, hw, lambda cfg: work, args.mesh))


def add_hardware_args(ap: argparse.ArgumentParser) -> None:
    """The GPU and link options of the CLIs (this one, scaling_calibration's)."""
    ap.add_argument("--gpus-per-node", type=int, default=Hardware.gpus_per_node)
    ap.add_argument("--peak-tflops", type=float, default=Hardware.peak_flops / 1e12)
    ap.add_argument("--nvlink-gbs", type=float, default=Hardware.nvlink_bytes_s / 1e9,
                    help="GB/s per GPU per direction inside a node")
    ap.add_argument("--ib-gbs", type=float, default=Hardware.ib_bytes_s / 1e9,
                    help="GB/s per GPU per direction between nodes")


def hardware(args: argparse.Namespace) -> Hardware:
    """The CLI's link and GPU options (add_hardware_args) as a Hardware."""
    return Hardware(gpus_per_node=args.gpus_per_node, peak_flops=args.peak_tflops * 1e12,
                    nvlink_bytes_s=args.nvlink_gbs * 1e9, ib_bytes_s=args.ib_gbs * 1e9)


def tables(models: Sequence[str], nodes: Sequence[int], hw: Hardware, work_of: Callable[[ModelConfig], Workload],
           mesh: str | None = None, label: str = "uncalibrated") -> str:
    """The prediction table of each model over the node counts; `work_of(cfg)` its workload (mfu per kind)."""
    out = []
    for name in models:
        cfg = model_config(name)
        work = work_of(cfg)
        preds = [predict(cfg, parse_mesh(mesh, n * hw.gpus_per_node) if mesh else default_plan(cfg, n, hw, work),
                         n, hw, work) for n in nodes]
        out.append(format_table(name, preds, label))
    return "\n\n".join(out)


if __name__ == "__main__":
    main()
