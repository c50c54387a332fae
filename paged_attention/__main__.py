"""Command line: ``python -m paged_attention check`` verifies every kernel on this machine;
``python -m paged_attention generate "PROMPT" [--max-tokens N]`` prints the packaged model's chat
answer (the first thing to run on a lab machine: it loads the model, the engine and the kernels);
``python -m paged_attention lab build OUT_DIR`` and ``lab grade SUBMISSION...`` (see ``paged_attention.lab``)."""
from __future__ import annotations

import argparse
import sys
import time

USAGE = ('usage: python -m paged_attention check | generate "PROMPT" [--max-tokens N] [--temperature T]\n'
         '       python -m paged_attention lab build OUT_DIR | lab grade SUBMISSION... [--csv FILE]')


def generate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m paged_attention generate",
                                     description="Answer one chat message with the packaged SmolLM2-135M-Instruct.")
    parser.add_argument("prompt", help="the user's message (the chat template is applied)")
    parser.add_argument("--max-tokens", type=int, default=128, help="at most this many new tokens (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--attention", default="auto", help="auto, reference, triton, cuda or vllm")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: what this machine has)")
    parser.add_argument("--stats", action="store_true", help="also print the load time and tokens/s to stderr")
    args = parser.parse_args(argv)

    from paged_attention.engine import LLM, SamplingParams
    from paged_attention.kernels import KernelUnavailable

    try:
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
        start = time.perf_counter()
        llm = LLM(attention=args.attention, device=args.device, num_cpu_blocks=0, max_num_seqs=1)
        loaded = time.perf_counter()
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
    except (ValueError, TypeError, KernelUnavailable, FileNotFoundError) as e:
        # Bad arguments, an attention this machine cannot run (CUDA without a GPU), or the
        # model's package not installed: each message says what to do, a traceback would not.
        print(f"error: {e}", file=sys.stderr)
        return 2
    done = time.perf_counter()
    print(out.outputs[0].text)
    if args.stats:
        n = len(out.outputs[0].token_ids)
        print(f"[{llm.model.device}, {llm.model.attention_impl} attention: model loaded in {loaded - start:.1f} s, "
              f"{n} tokens in {done - loaded:.2f} s ({n / (done - loaded):.1f} tokens/s)]", file=sys.stderr)
    return 0


def main(argv: list[str]) -> int:
    if argv == ["check"]:
        from paged_attention.check import main as check_main
        return check_main()
    if argv and argv[0] == "generate":
        return generate(argv[1:])
    if argv[:2] == ["lab", "grade"]:
        from paged_attention.lab.grade import main as grade_main
        return grade_main(argv[2:])
    if argv[:2] == ["lab", "build"] and len(argv) == 3:
        from paged_attention.lab.edition import build
        written = build(argv[2])
        print(f"student edition: {len(written)} notebooks in {argv[2]}")
        return 0
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
