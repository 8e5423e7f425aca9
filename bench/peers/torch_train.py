#!/usr/bin/env python3
"""The PyTorch side of `tandem bench train`: one training step (forward, the mean token
logprob's backward, AdamW) of a Llama-architecture model with the given shape (transformers'
LlamaForCausalLM, f32, CPU; with --autocast-bf16 the forward and backward run under
torch.autocast("cpu", bfloat16)), on B random sequences of L tokens. Prints one JSON object:
step_s (median of --steps after a warm-up), tokens (B * (L - 1) targets), torch and
transformers versions and the thread count.
"""
import argparse
import json
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True, help="JSON: vocab, hidden, intermediate, layers, heads, kv_heads, head_dim, rope_theta, tied")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--len", type=int, default=257)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--autocast-bf16", action="store_true",
                    help="forward and backward under torch.autocast('cpu', bfloat16); weights and AdamW stay f32")
    args = ap.parse_args()
    try:
        import torch
        import transformers
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        print(json.dumps({"error": f"torch/transformers not installed ({e}); run scripts/bench-peers"}))
        return 0
    torch.set_num_threads(args.threads)
    c = json.loads(args.config)
    cfg = LlamaConfig(vocab_size=c["vocab"], hidden_size=c["hidden"], intermediate_size=c["intermediate"],
                      num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
                      num_key_value_heads=c["kv_heads"], head_dim=c["head_dim"],
                      rope_theta=c["rope_theta"], tie_word_embeddings=c["tied"],
                      max_position_embeddings=max(2048, args.len))
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, c["vocab"], (args.batch, args.len))
    times = []
    for i in range(args.steps + 1):
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast_bf16):
            logits = model(input_ids=ids[:, :-1], use_cache=False).logits
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = -logp.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if i > 0:
            times.append(time.perf_counter() - t0)
    print(json.dumps({"step_s": statistics.median(times), "tokens": args.batch * (args.len - 1),
                      "torch": torch.__version__, "transformers": transformers.__version__,
                      "threads": torch.get_num_threads()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
