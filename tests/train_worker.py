"""train.py with test-only changes, chosen by NANOGEN_TEST_WORKER (a script the tests run, in
a subprocess or under torchrun; the production code carries no hook for any of them):
    fast_clock           rank 1's clock (train.py's time.time) runs 20x fast
    count_build          print "BUILD rank R" whenever data preparation really builds a folder
    kill=step:N          SIGKILL after the N-th training step's backward (before its update)
    kill=evaluation:N    SIGKILL as the N-th evaluation starts
    kill=checkpoint:N    SIGKILL inside the N-th checkpoint write: the temporary file is
                         complete, the rename not done
    sigint=N             SIGINT (a Ctrl-C) during the N-th training step, after its backward
    sigterm=N            rank 1 alone sends itself SIGTERM during its N-th training step
    sigterm_at_exit=N    sigterm=N, and every process gets SIGTERM again as its process group is
                         destroyed (a scheduler's second signal), then prints its threads left
"""

import atexit
import os
import signal
import sys
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common
import train  # noqa: E402

mode, rank = os.environ.get("NANOGEN_TEST_WORKER", ""), int(os.environ.get("RANK", "0"))


def kill_on(n, fn, when=lambda *a, **k: True, sig=signal.SIGKILL):
    """fn, except that its n-th call (among those `when` accepts) sends this process `sig`."""
    calls = [0]

    def wrapped(*a, **k):
        if when(*a, **k):
            calls[0] += 1
            if calls[0] == n:
                os.kill(os.getpid(), sig)
        return fn(*a, **k)

    return wrapped


def print_threads():  # this process's threads by name, in one write (the processes share stdout)
    names = (
        open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")
    )
    os.write(1, f"threads left: {' '.join(names)}\n".encode())


if mode == "fast_clock" and rank == 1:
    t0 = time.time()
    train.time = types.SimpleNamespace(time=lambda: t0 + 20 * (time.time() - t0))
elif mode == "count_build":
    import data.prepare as prepare

    build = prepare.build

    def counted_build(*a, **k):
        print(f"BUILD rank {rank}", flush=True)
        return build(*a, **k)

    prepare.build = counted_build
elif mode.split("=")[0] in ("sigterm", "sigterm_at_exit"):
    if rank == 1:  # (score: one call a step here, and none in an evaluation before step 4)
        train.get_batch = kill_on(int(mode.split("=")[1]), train.get_batch, sig=signal.SIGTERM)
    if mode.startswith("sigterm_at_exit="):
        import torch.distributed

        torch.distributed.destroy_process_group = kill_on(
            1, torch.distributed.destroy_process_group, sig=signal.SIGTERM
        )
        atexit.register(print_threads)
elif mode.startswith("sigint="):
    torch.nn.utils.clip_grad_norm_ = kill_on(
        int(mode[len("sigint=") :]), torch.nn.utils.clip_grad_norm_, sig=signal.SIGINT
    )
elif mode.startswith("kill="):
    where, n = mode[len("kill=") :].split(":")
    if where == "step":  # clipping: after the step's backward, before its update
        torch.nn.utils.clip_grad_norm_ = kill_on(int(n), torch.nn.utils.clip_grad_norm_)
    elif where == "evaluation":
        train.validate = kill_on(int(n), train.validate)
    elif where == "checkpoint":
        os.replace = kill_on(int(n), os.replace, lambda src, dst: str(dst).endswith(".pt"))
common.run(lambda: train.main(sys.argv[1:]))
