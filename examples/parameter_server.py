"""A parameter server as an actor: workers pull weights and push gradients.

Rank 0 hosts a ``ParameterServer`` actor holding the weights of a small linear
model. Every other rank is a worker that, ``STEPS`` times, pulls the current
weights (``await ps.pull()``), computes a gradient on a batch of synthetic data
with torch autograd, and pushes it (``await ps.push(grads)``), which applies
one SGD step on the server. An actor handles one message at a time, so pushes
from different workers never interleave. Weights and gradients travel as
dicts of tensors (no pickle).

When the workers are done, the server prints its loss on held-out data before
and after training: ``parameter server: loss X -> Y``.

Needs at least 2 ranks:

    asyncomm run -n 4 examples/parameter_server.py
    asyncomm run -n 4 --backend mpi examples/parameter_server.py
"""

import torch

import asyncomm

FEATURES, BATCH, STEPS, LR = 8, 32, 30, 0.05


def synthetic_data(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` samples of y = x . w_true + 1 + noise; the same w_true on every rank."""
    w_true = torch.linspace(-1.0, 1.0, FEATURES)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    y = x @ w_true + 1.0 + 0.01 * torch.randn(n, generator=g)
    return x, y.unsqueeze(1)


class ParameterServer(asyncomm.Actor):
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(FEATURES, 1)
        self.updates = 0

    @asyncomm.endpoint
    async def pull(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self.model.named_parameters()}

    @asyncomm.endpoint
    async def push(self, grads: dict[str, torch.Tensor]) -> int:
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.add_(grads[name], alpha=-LR)
        self.updates += 1
        return self.updates

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> float:
        with torch.no_grad():
            return torch.nn.functional.mse_loss(self.model(x), y).item()


async def main(comm: asyncomm.Comm) -> None:
    if comm.size < 2:
        print("parameter_server needs at least 2 ranks: "
              "asyncomm run -n 4 examples/parameter_server.py")
        return

    if comm.rank == 0:
        server = ParameterServer()
        x_test, y_test = synthetic_data(seed=0, n=256)
        before = server.loss(x_test, y_test)
        comm.serve(server, name="ps")  # answers requests while this rank awaits below
    await comm.barrier()  # served before anyone calls: a call to no actor fails at once
    if comm.rank != 0:
        ps = comm.actor(0, "ps")
        model = torch.nn.Linear(FEATURES, 1)
        params = dict(model.named_parameters())
        for step in range(STEPS):
            model.load_state_dict(await ps.pull())
            x, y = synthetic_data(seed=1000 * comm.rank + step, n=BATCH)
            loss = torch.nn.functional.mse_loss(model(x), y)
            grads = torch.autograd.grad(loss, list(params.values()))
            await ps.push(dict(zip(params, grads, strict=True)))

    await comm.barrier()  # every worker has pushed its last gradient
    if comm.rank == 0:
        after = server.loss(x_test, y_test)
        print(f"parameter server: {server.updates} updates from {comm.size - 1} workers")
        print(f"parameter server: loss {before:.4f} -> {after:.4f}")


if __name__ == "__main__":
    asyncomm.run(main)
