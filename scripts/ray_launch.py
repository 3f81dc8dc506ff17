"""Run a surojax command on a Ray cluster: one Ray task per node, each starting that node's JAX processes.

    python scripts/ray_launch.py --nodes 4 -- surojax sft configs/my_run.yaml -o parallel.data=4

Ray only places the work: a placement group reserves `--gpus-per-node` GPUs on each of `--nodes` distinct nodes
(STRICT_SPREAD), the first bundle's node hosts the JAX coordinator, and every node runs

    surojax launch --nproc-per-node G --nnodes N --node-rank R --coordinator HOST:PORT -- <command>

so the processes meet through jax.distributed exactly as under SLURM or a hand-started `surojax launch`
(docs/multi_gpu.md). Ray is not a dependency of surojax: install it where the cluster runs (`pip install ray`).
If any node's command fails, the other nodes' tasks are cancelled and this script exits with its status.
"""
from __future__ import annotations

import argparse
import socket
import subprocess
import sys


def free_port() -> int:
    """A TCP port free on this node now (the coordinator binds it a few seconds later)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def launch_command(command: list[str], *, gpus_per_node: int, nodes: int, rank: int, coordinator: str) -> list[str]:
    """The per-node command line (`surojax launch`'s flags, surojax/cli/launch.py)."""
    return ["surojax", "launch", "--nproc-per-node", str(gpus_per_node), "--nnodes", str(nodes),
            "--node-rank", str(rank), "--coordinator", coordinator, "--", *command]


def run_node(command: list[str]) -> int:
    """Body of one node's Ray task: run the command, stream its output to the driver (Ray forwards it)."""
    return subprocess.run(command, check=False).returncode


def coordinator_address() -> str:
    """Body of the task on the first bundle: this node's IP and a free port."""
    import ray  # optional dependency (module docstring)

    return f"{ray.util.get_node_ip_address()}:{free_port()}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--cpus-per-node", type=int, default=16)
    ap.add_argument("--address", default="auto", help="Ray cluster address (default: the one this node belongs to)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- followed by the surojax command")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the command after --, e.g. -- surojax sft run.yaml")
    try:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    except ImportError:
        print("scripts/ray_launch.py needs Ray, which surojax does not install: pip install ray "
              "(or start the nodes with SLURM / surojax launch: docs/multi_gpu.md)", file=sys.stderr)
        return 2

    ray.init(address=args.address)
    bundle = {"GPU": args.gpus_per_node, "CPU": args.cpus_per_node}
    pg = placement_group([bundle] * args.nodes, strategy="STRICT_SPREAD")
    ray.get(pg.ready())

    def on_bundle(fn, i):
        return ray.remote(num_gpus=args.gpus_per_node, num_cpus=args.cpus_per_node, max_retries=0)(fn).options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i))

    coordinator = ray.get(on_bundle(coordinator_address, 0).remote())
    print(f"ray_launch: {args.nodes} nodes x {args.gpus_per_node} GPUs, coordinator {coordinator}", flush=True)
    tasks = [on_bundle(run_node, rank).remote(launch_command(command, gpus_per_node=args.gpus_per_node,
                                                             nodes=args.nodes, rank=rank, coordinator=coordinator))
             for rank in range(args.nodes)]
    status, pending = 0, list(tasks)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        code = ray.get(done[0])
        if code != 0 and status == 0:
            status = code
            print(f"ray_launch: node {tasks.index(done[0])} exited with {code}; stopping the others", file=sys.stderr)
            for t in pending:
                ray.cancel(t, force=True)
            break
    return status


if __name__ == "__main__":
    sys.exit(main())
