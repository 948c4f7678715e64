"""Start a ``jaxrunner`` command on several hosts: ``jax.distributed.initialize``, then the command.

Run the same command on every host, with its own process id::

    python -m jaxrunner.launch --coordinator-address host0:1234 --num-processes 2 --process-id 0 \\
        generate --model /path/to/checkpoint --tensor-parallel-size 16

Without the three flags ``jax.distributed.initialize()`` reads them from the
cluster (SLURM, Open MPI, Kubernetes JobSet, ...). Once it has run,
``jax.devices()`` lists every host's devices and ``jaxrunner.sharding.make_mesh``
lays the mesh over them: the code path is the one-host path. Every process runs
the same engine on the same prompts (JAX's multi-controller model: each steps
every replica, whose programs span the hosts) and prints the same outputs.

Several hosts have not been tested (the project's machines have one host each).
"""

from __future__ import annotations

import argparse

import jax

from jaxrunner import cli


def main(argv: list[str] | None = None) -> None:
    """Parse ``argv``, start JAX's distributed runtime, then run the jaxrunner command."""
    parser = argparse.ArgumentParser(
        prog="python -m jaxrunner.launch",
        description="jax.distributed.initialize, then a jaxrunner command (generate, bench) with its flags.",
    )
    parser.add_argument("--coordinator-address", default=None, help="host:port of process 0's coordinator")
    parser.add_argument("--num-processes", type=int, default=None)
    parser.add_argument("--process-id", type=int, default=None)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the jaxrunner command and its flags")
    args = parser.parse_args(argv)
    jax.distributed.initialize(
        coordinator_address=args.coordinator_address, num_processes=args.num_processes, process_id=args.process_id
    )
    cli.main(args.command)


if __name__ == "__main__":
    main()
