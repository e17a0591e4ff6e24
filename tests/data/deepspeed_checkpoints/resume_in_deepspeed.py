"""Resume a checkpoint in DeepSpeed itself (an export from ds_strategy) and train the fixtures'
3 more steps; rank 0 writes DeepSpeed's consolidated weights after them to OUT.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 resume_in_deepspeed.py CKPT CONFIG.json OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from make_fixtures import MORE, STEPS, model, train  # noqa: E402


def main() -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file, save_file

    ckpt, config, out = (
        Path(sys.argv[1]),
        json.loads(Path(sys.argv[2]).read_text()),
        Path(sys.argv[3]),
    )
    dtype = torch.bfloat16 if (config.get("bf16") or {}).get("enabled") else torch.float32
    dtype = torch.float16 if (config.get("fp16") or {}).get("enabled") else dtype
    deepspeed.init_distributed(dist_backend="gloo")
    net = model()
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    _, client = engine.load_checkpoint(ckpt)
    train(engine, load_file(HERE / "batches.safetensors"), range(STEPS, STEPS + MORE), dtype)
    engine.save_checkpoint(out.parent / "after")
    dist.barrier()
    if dist.get_rank() == 0:
        state = get_fp32_state_dict_from_zero_checkpoint(str(out.parent / "after"))
        save_file({k: v.contiguous() for k, v in state.items()}, out)
        (out.parent / "client_state.json").write_text(
            json.dumps({k: client[k] for k in ("epoch",) if k in client})
        )
        print("global_steps", engine.global_steps, "client", client.get("epoch"))


if __name__ == "__main__":
    main()
