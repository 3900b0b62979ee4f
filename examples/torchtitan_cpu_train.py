"""Train torchtitan 0.3.0 with spmd_types checking on CPU, under torchrun with gloo: the launcher docs/torchtitan.md names.

Two steps, nothing fetched:

    python examples/torchtitan_cpu_train.py prepare /tmp/titan   # a tokenizer and a text dataset, made here
    torchrun --nproc_per_node 4 examples/torchtitan_cpu_train.py \\
        --module llama3 --config llama3_debugmodel \\
        --hf_assets_path /tmp/titan/tokenizer --dataloader.dataset_path /tmp/titan/c4_test \\
        --parallelism.spmd_backend spmd_types --debug.spmd_typechecking \\
        --parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 2 \\
        --activation_checkpoint.mode none --training.steps 2 --training.seq_len 64 --training.local_batch_size 2

Everything after the launcher's name is torchtitan's own command line
(``torchtitan.train``'s, parsed by torchtitan); the launcher only makes
torchtitan run on a machine with no GPU, in three accommodations:

* the device is the CPU and its process-group backend gloo (torchtitan picks
  ``cuda`` when it finds no accelerator);
* FlexAttention runs as dense math (torch's flex attention has no CPU backward,
  and torchtitan compiles it): softmax(q k^T / sqrt(d), masked by the block
  mask's ``mask_mod``) v, and the block mask is made eagerly;
* FSDP2 sums gradients with plain SUM: torchtitan turns FSDP's division off
  (``set_gradient_divide_factor(1.0)``), which FSDP then does with NCCL's
  ``PREMUL_SUM(1.0)``; gloo has no PREMUL_SUM, and a SUM is the same sum;
* nothing else: compile stays off (the default), and activation checkpointing
  is turned off on the command line (``--activation_checkpoint.mode none``),
  as torchtitan's own spmd_types recipes do when checking is on.

``prepare DIR`` writes ``DIR/tokenizer`` (a byte-level BPE tokenizer trained
here with the ``tokenizers`` package on synthetic text, vocabulary under the
debug model's 2048) and ``DIR/c4_test`` (a JSON-lines dataset of that text,
in the ``{"text": ...}`` shape torchtitan's ``c4_test`` loader reads).
"""

from __future__ import annotations

import json
import math
import os
import random
import sys

WORDS = ("tensor", "parallel", "shard", "replicate", "gradient", "sum", "rank", "mesh", "axis", "type", "check",
         "loss", "step", "model", "layer", "token", "expert", "route", "batch", "sequence")


def synthetic_text(lines: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 120))) + "." for _ in range(lines)]


def prepare(folder: str) -> None:
    """Write a tokenizer and a small text dataset under ``folder`` (both made here, nothing downloaded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = synthetic_text(400)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<unk>"]
    tokenizer.train_from_iterator(text, trainers.BpeTrainer(vocab_size=512, special_tokens=specials))
    os.makedirs(os.path.join(folder, "tokenizer"), exist_ok=True)
    tokenizer.save(os.path.join(folder, "tokenizer", "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer", "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": True,
                   "add_eos_token": True}, f)
    os.makedirs(os.path.join(folder, "c4_test"), exist_ok=True)
    with open(os.path.join(folder, "c4_test", "train.json"), "w") as f:
        for line in text:
            f.write(json.dumps({"text": line}) + "\n")


def dense_flex_attention(q, k, v, *, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                         return_aux=None, kernel_options=None):
    """torch's ``flex_attention`` as dense math (what the models here ask of it: a block mask, no score_mod)."""
    import torch
    from torch.nn.attention.flex_attention import AuxOutput, create_mask

    if score_mod is not None:
        raise NotImplementedError("the CPU launcher's dense flex attention takes no score_mod")
    _, heads, q_len, head_dim = q.shape
    mask = create_mask(block_mask.mask_mod, block_mask.shape[0], 1, q_len, k.shape[2], device="cpu")
    if enable_gqa and k.shape[1] != heads:
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
        v = v.repeat_interleave(heads // v.shape[1], dim=1)
    scores = (q @ k.transpose(-2, -1)) * (scale if scale is not None else 1 / math.sqrt(head_dim))
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1) @ v
    return out, AuxOutput(lse=lse if return_aux is not None and return_aux.lse else None)


class CpuDeviceModule:
    """``torch.cpu`` with the memory and device queries torchtitan asks of ``torch.cuda`` (no CUDA memory here)."""

    def __getattr__(self, name: str):
        import torch

        return getattr(torch.cpu, name)

    @staticmethod
    def get_device_name(device=None) -> str:
        return "cpu"

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def get_device_properties(device=None):
        import types

        return types.SimpleNamespace(total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    @staticmethod
    def memory_stats(device=None) -> dict:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None


def accommodate_cpu() -> None:
    """The launcher's accommodations (see the module docstring), made after torchtitan is imported."""
    import torch
    import torch.distributed as dist
    import torchtitan.models.common.attention as attention
    import torchtitan.train  # noqa: F401 - imports the trainer and the modules that read the device type
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.attention.flex_attention import create_block_mask

    cpu = CpuDeviceModule()
    for name, module in list(sys.modules.items()):
        if name.startswith("torchtitan") and module is not None:
            if getattr(module, "device_type", None) == "cuda":
                module.device_type = "cpu"
            if getattr(module, "device_module", None) is torch.cuda:
                module.device_module = cpu
    import torchtitan.tools.utils as tools_utils

    tools_utils.get_local_device = lambda: torch.device("cpu")
    dist.Backend.default_device_backend_map.setdefault("cpu", "gloo")
    import torchtitan.distributed.fsdp as titan_fsdp

    divide_off = titan_fsdp.disable_fsdp_gradient_division

    def divide_off_with_sum(model: torch.nn.Module) -> None:
        divide_off(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    for name, module in list(sys.modules.items()):
        if name.startswith("torchtitan") and getattr(module, "disable_fsdp_gradient_division", None) is divide_off:
            module.disable_fsdp_gradient_division = divide_off_with_sum
    attention.FlexAttention._compiled_flex_attn = staticmethod(dense_flex_attention)
    attention._compiled_create_block_mask = create_block_mask


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "prepare":
        prepare(sys.argv[2])
        return
    accommodate_cpu()
    from torchtitan.train import main as train

    train()


if __name__ == "__main__":
    main()
