"""lit_rlhf/utils/distributed.py: sum, min and max over two real gloo processes, and no-ops alone."""

import torch

from lit_rlhf.utils.distributed import all_reduce_max, all_reduce_min, all_reduce_sum


def _rank(rank: int, store_path: str, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    try:
        values = {0: [1.0, -2.0, 5.0], 1: [3.0, 4.0, -7.0]}[rank]
        results = {
            name: fn(torch.tensor(values)).tolist()
            for name, fn in (("sum", all_reduce_sum), ("min", all_reduce_min), ("max", all_reduce_max))
        }
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_reductions_over_two_processes(tmp_path):
    import torch.multiprocessing as mp

    mp.start_processes(_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method="spawn")
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got == {"sum": [4.0, 2.0, -2.0], "min": [1.0, -2.0, -7.0], "max": [3.0, 4.0, 5.0]}  # by hand


def test_reductions_alone_leave_the_tensor_as_it_is():
    x = torch.tensor([1.0, -2.0])
    assert all_reduce_max(x) is x and all_reduce_min(x) is x and all_reduce_sum(x) is x
    assert x.tolist() == [1.0, -2.0]
