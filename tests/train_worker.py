"""train.py with test-only changes, chosen by NANOGEN_TEST_WORKER (a script the tests run, in
a subprocess or under torchrun; the production code carries no hook for any of them):
    fast_clock           rank 1's clock (train.py's time.time) runs 20x fast
    count_build          print "BUILD rank R" whenever data preparation really builds a folder
    kill=step:N          SIGKILL after the N-th training step's backward (before its update)
    kill=evaluation:N    SIGKILL as the N-th evaluation starts
    kill=checkpoint:N    SIGKILL inside the N-th checkpoint write: the temporary file is
                         complete, the rename not done
    sigterm=N            rank 1 alone sends itself SIGTERM during its N-th training step
    sigterm_at_exit=N    sigterm=N, and every process gets SIGTERM again as its process group is
                         destroyed (a scheduler's second signal)
    sigterm_in_vote=N    rank 0 alone gets SIGTERM while the N-th step's stop vote is under way
                         (its own vote, "go on", already given)
"""
import os
import signal
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cli  # noqa: E402
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


if mode == "fast_clock" and rank == 1:
    t0 = time.time()
    train.time = types.SimpleNamespace(time=lambda: t0 + 20 * (time.time() - t0))
elif mode == "count_build":
    import data.prepare as prepare
    build = prepare._build

    def counted(*a, **k):
        print(f"BUILD rank {rank}", flush=True)
        return build(*a, **k)
    prepare._build = counted
elif mode.split("=")[0] in ("sigterm", "sigterm_at_exit"):
    if rank == 1:
        train.accumulate = kill_on(int(mode.split("=")[1]), train.accumulate, sig=signal.SIGTERM)
    if mode.startswith("sigterm_at_exit="):
        import torch.distributed
        torch.distributed.destroy_process_group = kill_on(
            1, torch.distributed.destroy_process_group, sig=signal.SIGTERM)
elif mode.startswith("sigterm_in_vote=") and rank == 0:
    all_sum = cli.Dist.all_sum

    def vote(self, values):
        out = all_sum(self, values)
        vote.calls += len(values) == 2  # runs.Run.should_stop's (limit, signal) vote
        if vote.calls == int(mode[len("sigterm_in_vote="):]):
            os.kill(os.getpid(), signal.SIGTERM)  # its handler runs before this returns
        return out
    vote.calls = 0
    cli.Dist.all_sum = vote
elif mode.startswith("kill="):
    where, n = mode[len("kill="):].split(":")
    if where == "step":
        accumulate = train.accumulate

        def step(*a, **k):
            out = accumulate(*a, **k)
            step.calls += 1
            if step.calls == int(n):
                os.kill(os.getpid(), signal.SIGKILL)
            return out
        step.calls = 0
        train.accumulate = step
    elif where == "evaluation":
        train.validate = kill_on(int(n), train.validate)
    elif where == "checkpoint":
        os.replace = kill_on(int(n), os.replace, lambda src, dst: str(dst).endswith(".pt"))
sys.exit(cli.run_cli(train.main, sys.argv[1:]))
