"""ZeRO-3 through ``ZeroAccelerator`` with Accelerate's ``torch.compile`` settings from the
accelerate config file's dynamo section: the same loop as ``parity.py``'s stage 3 run. Rank 0
saves the consolidated weights, the engine's ``compile`` section and its compile report.

    accelerate launch --config_file <cpu_2proc.yaml + dynamo_config> \\
        tests/accelerate_scripts/compiled.py --out results.pt
"""

from __future__ import annotations

from accelerate import Accelerator
from common import arguments, build, save_on_main, train, zero_accelerator


def main() -> None:
    args = arguments()
    accelerator = zero_accelerator(3)
    model, optimizer, loader, scheduler = accelerator.prepare(*build())
    log = train(accelerator, model, optimizer, loader, scheduler)
    engine = accelerator.zero_engine
    result = {
        **log,
        "state": accelerator.get_state_dict(model),
        "compile": engine.config.compile,
        "report": engine.compile_report(),
    }
    save_on_main(Accelerator(), result, args.out)


if __name__ == "__main__":
    main()
