"""Rank 1 dies (SIGKILL, or SIGSTOP to hang) at step KILL_AT; the survivors must fail fast.

argv: OUT_DIR MODE with MODE "kill" or "stop". Rank 1 writes dead.json (the time it
died); rank 0 writes error.json (when and what it raised) and exits 1.
"""
import os
import signal
import sys
import time

import _common as C

import pimm_fn.distributed as D
from pimm_fn.state import TrainState

KILL_AT = 5


def main():
    out, mode = C.out_dir(), sys.argv[2]
    ctx = D.init_from_env()
    state = TrainState.create(C.MLP(), C.optimizer("sgd", 0.05), seed=0)
    step = D.data_parallel()
    data = C.dataset(400)
    try:
        with D.guard():
            for i, batch in enumerate(C.loader(data, 4, ctx.rank, ctx.world_size).iter_epoch(0)):
                if i == KILL_AT and ctx.rank == 1:
                    C.write_json(os.path.join(out, "dead.json"), {"t": time.time(), "pid": os.getpid()})
                    os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
                state, m = step(state, batch)
                float(m["loss"])  # the host reads the metrics every step, as a logger does
    except D.PeerLostError as e:
        C.write_json(os.path.join(out, f"error_rank{ctx.rank}.json"),
                     {"t": time.time(), "type": type(e).__name__, "message": str(e),
                      "cause": f"{type(e.__cause__).__name__}: {str(e.__cause__)[:500]}"})
        print(f"pimm_fn rank {ctx.rank}: {e}", file=sys.stderr, flush=True)
        D.shutdown()
        sys.exit(1)
    C.write_json(os.path.join(out, f"finished_rank{ctx.rank}.json"), {"t": time.time()})


if __name__ == "__main__":
    main()
