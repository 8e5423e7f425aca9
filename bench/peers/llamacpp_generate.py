#!/usr/bin/env python3
"""The llama.cpp side of `tandem bench generate`: greedy decoding of one prompt at batch 1 with
llama-cpp-python on a GGUF file, timed the way tandem times itself (prefill, then decode).

Prints one JSON object: prompt_tokens, new_tokens, prefill_s, decode_s, tokens (the generated ids).
Run by `tandem bench generate` with the interpreter of the bench venv (scripts/bench-peers).
"""
import argparse
import json
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-ids", required=True, help="comma-separated token ids")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    try:
        import llama_cpp
        import numpy as np
    except ImportError as e:
        print(json.dumps({"error": f"llama-cpp-python is not installed ({e}); run scripts/bench-peers"}))
        return 0

    ids = [int(t) for t in args.prompt_ids.split(",") if t]
    n_ctx = len(ids) + args.new_tokens + 8
    llm = llama_cpp.Llama(model_path=args.model, n_ctx=n_ctx, n_batch=max(len(ids), 8),
                          n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
    n_vocab = llm.n_vocab()
    best = None
    for _ in range(args.repeats):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        t1 = time.perf_counter()
        out = []
        for _ in range(args.new_tokens):
            # The last token's logits, straight from the context (the one row eval asked for).
            logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))
            tok = int(logits.argmax())
            out.append(tok)
            llm.eval([tok])
        t2 = time.perf_counter()
        run = {"prompt_tokens": len(ids), "new_tokens": len(out), "prefill_s": t1 - t0,
               "decode_s": t2 - t1, "tokens": out}
        if best is None or run["decode_s"] < best["decode_s"]:
            best = run
    print(json.dumps(best))
    return 0


if __name__ == "__main__":
    sys.exit(main())
