"""A 2-worker Ray Train TorchTrainer on CPU whose train loop calls ``dtrain.init()`` on the process
group Ray Train made, trains a few DDP steps with ``ctx.setup`` and writes what each rank saw to
OUT. Usage: ``python ray_train_loop.py OUT`` (a Ray instance of this machine, started here)."""

import json
import os
import sys


def train_loop(config: dict) -> None:
    import torch
    import torch.distributed as dist

    import dtrain

    group = dist.group.WORLD  # Ray Train's, made before this function runs
    ctx = dtrain.init(seed=0)
    total = ctx.all_reduce(torch.tensor([float(ctx.rank + 1)]), op="sum").item()
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ctx.setup(model, opt)
    torch.manual_seed(ctx.rank)  # different data per rank: DDP must average the gradients
    for _ in range(3):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        ctx.backward(loss)
        opt.step()
        opt.zero_grad()
    weights = [round(v, 6) for v in torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()]
    record = {"rank": ctx.rank, "world": ctx.world_size, "sum": total, "same_group": dist.group.WORLD is group,
              "source": ctx.world.source, "weights": weights}
    ctx.close()
    with open(os.path.join(config["out"], f"rank{record['rank']}.json"), "w") as f:
        json.dump(record, f)


def main() -> None:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = os.path.abspath(sys.argv[1])
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")  # its own, never a running one
    try:
        trainer = TorchTrainer(train_loop, train_loop_config={"out": out},
                               scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                               run_config=RunConfig(storage_path=os.path.join(out, "ray")))
        trainer.fit()
    finally:
        ray.shutdown()
    print("RAY_TRAIN_DONE", flush=True)


if __name__ == "__main__":
    main()
