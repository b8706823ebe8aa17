"""Running a function on several gloo ranks from a test, each in a fresh process, with a timeout."""

import multiprocessing as mp
import os
import socket
import traceback

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(fn, rank, world_size, port, args, errors):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, *args)
        dist.barrier()  # neither rank tears gloo down while the other still talks to it
    except BaseException as err:  # reported to the test, which fails with it
        errors.put((rank, f"{type(err).__name__}: {err}", traceback.format_exc()))
    finally:
        dist.destroy_process_group()
    # Skip interpreter teardown: under load, torch's and gloo's background threads sometimes abort it
    # ("terminate called without an active exception") after all the work above has finished.
    errors.close()
    errors.join_thread()
    os._exit(0)


def run_ranks(fn, *args, world_size: int = 2, timeout: float = 120.0) -> dict[int, str]:
    """Run ``fn(rank, *args)`` on ``world_size`` gloo ranks; returns {rank: error message} of ranks that
    raised (empty when all succeeded). ``fn`` must be importable (a module-level function)."""
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_entry, args=(fn, r, world_size, port, args, errors)) for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            pytest.fail(f"a rank did not finish within {timeout} s")
    failed = {}
    while not errors.empty():
        rank, message, _ = errors.get()
        failed[rank] = message
    for p in procs:
        assert p.exitcode == 0 or failed, f"a rank died with exit code {p.exitcode}"
    return failed
