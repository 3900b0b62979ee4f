"""Run torch's own distributed features on plain tensors and print what they give, as JSON.

Run twice by ``tests/test_torch_untouched.py``: once as a user of this
environment has it (``spmd_types`` installed, so torch 2.14's FSDP2 and DTensor
import it), once with torch told it is absent
(``torch.distributed._spmd_types_available = False``, the flag torch caches
``importlib.util.find_spec("spmd_types")`` in). The two outputs must be equal.
"""

from __future__ import annotations

import json
import sys
import tempfile

import torch
import torch.distributed as dist

if sys.argv[1] == "hidden":
    dist._spmd_types_available = False  # as if the package were not installed

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: E402


def fsdp_step() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    return {"loss": loss.item(), "params": [p.full_tensor().tolist() for p in model.parameters()]}


def from_local() -> dict:
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    local = torch.arange(6.0).reshape(2, 3)
    dt = DTensor.from_local(local, mesh, [Shard(0)])
    return {"placements": [str(p) for p in dt.redistribute(mesh, [Replicate()]).placements],
            "full": dt.full_tensor().tolist()}


def compiled() -> list:
    fn = torch.compile(lambda a, b: torch.relu(a @ b) + 1)
    return fn(torch.ones(3, 3), torch.eye(3)).tolist()


def main() -> None:
    with tempfile.NamedTemporaryFile() as store:
        dist.init_process_group("gloo", init_method=f"file://{store.name}", rank=0, world_size=1)
        try:
            out = {"fsdp": fsdp_step(), "from_local": from_local(), "compile": compiled()}
        finally:
            dist.destroy_process_group()
    out["spmd_types imported"] = "spmd_types" in sys.modules
    print(json.dumps(out))


if __name__ == "__main__":
    main()
