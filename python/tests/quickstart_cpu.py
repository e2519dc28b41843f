# The torchcomms Quick Start (README "Quick Start Example") with its import
# changed to ftcomm and, for machines without GPUs, gloo on the CPU.
import torch
from ftcomm import new_comm, ReduceOp


def main():
    device = torch.device("cpu")
    torchcomm = new_comm("gloo", device, name="main_comm")
    rank = torchcomm.get_rank()
    world_size = torchcomm.get_size()
    print(f"Rank {rank}/{world_size}: Running on the CPU")
    tensor = torch.full((1024,), float(rank + 1), dtype=torch.float32, device=device)
    print(f"Rank {rank}: Before AllReduce: {tensor[0].item()}")
    torchcomm.all_reduce(tensor, ReduceOp.SUM, async_op=False)
    print(f"Rank {rank}: After AllReduce: {tensor[0].item()}")
    torchcomm.finalize()


if __name__ == "__main__":
    main()
