#!/usr/bin/env python3
"""The llama.cpp side of `tandem bench rollout`: B sequences decoded together with llama.cpp's
batched API (one llama_batch per step, one sequence id per prompt), greedy, through
llama-cpp-python's low-level bindings.

Input: --prompts FILE, a JSON list of B token-id lists. Prints one JSON object: batch,
prompt_tokens, new_tokens (all sequences), prefill_s, decode_s (the best of --repeats runs) and
tokens (sequence 0's greedy tokens).
"""
import argparse
import ctypes
import json
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    try:
        import llama_cpp as L
        import numpy as np
    except ImportError as e:
        print(json.dumps({"error": f"llama-cpp-python is not installed ({e}); run scripts/bench-peers"}))
        return 0

    prompts = json.load(open(args.prompts))
    B, N = len(prompts), args.new_tokens
    total_prompt = sum(len(p) for p in prompts)
    L.llama_backend_init()
    model = L.llama_model_load_from_file(args.model.encode(), L.llama_model_default_params())
    cp = L.llama_context_default_params()
    cp.n_ctx = total_prompt + B * N + 64
    cp.n_batch = max(total_prompt, B)
    cp.n_ubatch = min(512, cp.n_batch)
    cp.n_seq_max = B
    cp.n_threads = cp.n_threads_batch = args.threads
    ctx = L.llama_init_from_model(model, cp)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(max(total_prompt, B), 0, B)

    def add(tok, pos, seq, want_logits):
        i = batch.n_tokens
        batch.token[i] = tok
        batch.pos[i] = pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = want_logits
        batch.n_tokens = i + 1

    def argmax(i):
        return int(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).argmax())

    best = None
    for _ in range(args.repeats):
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        t0 = time.perf_counter()
        batch.n_tokens = 0
        last = []
        for s, p in enumerate(prompts):
            for j, tok in enumerate(p):
                add(tok, j, s, j == len(p) - 1)
            last.append(batch.n_tokens - 1)
        if L.llama_decode(ctx, batch) != 0:
            print(json.dumps({"error": "llama_decode failed in prefill"}))
            return 0
        cur = [argmax(i) for i in last]
        t1 = time.perf_counter()
        out0 = [cur[0]]
        for step in range(N - 1):
            batch.n_tokens = 0
            for s in range(B):
                add(cur[s], len(prompts[s]) + step, s, True)
            if L.llama_decode(ctx, batch) != 0:
                print(json.dumps({"error": "llama_decode failed in decode"}))
                return 0
            cur = [argmax(i) for i in range(B)]
            out0.append(cur[0])
        t2 = time.perf_counter()
        run = {"batch": B, "prompt_tokens": total_prompt, "new_tokens": B * N,
               "decode_steps": N - 1, "prefill_s": t1 - t0, "decode_s": t2 - t1, "tokens": out0}
        if best is None or run["decode_s"] < best["decode_s"]:
            best = run
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    print(json.dumps(best))
    return 0


if __name__ == "__main__":
    sys.exit(main())
