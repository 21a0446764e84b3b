"""Run under mpiexec by tests/test_mpi.py: our collectives, DDP and ZeRO on course_lib.mpi.
Writes rank-<r>.json (plain data: numbers and strings) into the folder given."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_mpi import check_collectives, ddp_params  # noqa: E402

from course_lib import mpi  # noqa: E402


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    mpi.init_process_group(timeout=60)
    rank, world = mpi.get_rank(), mpi.get_world_size()
    out = {"bad": check_collectives(mpi, rank, world)}
    out.update({k: v.tolist() for k, v in ddp_params(rank, world, mpi).items()})
    if rank == 0:  # a peer that never sends: an error naming rank, operation and peer
        work = mpi.irecv(torch.empty(3), src=1, tag=77)
        try:
            work.wait(timeout=0.5)
            out["timeout"] = None
        except mpi.DistTimeoutError as exc:
            out["timeout"] = str(exc)
        work.request.Cancel()
        work.request.Wait()
    mpi.barrier()
    Path(out_dir, f"rank-{rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
