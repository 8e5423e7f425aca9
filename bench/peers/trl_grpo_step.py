#!/usr/bin/env python3
"""The TRL side of `tandem bench step`: GRPO steps of TRL's GRPOTrainer on the CPU (f32, or
bf16 = True: torch.autocast to bf16 with f32 weights; transformers' generate, no vLLM) with the settings, prompts and stop tokens tandem's job used.

--model: an HF directory (tandem writes it from the same weights). --input: JSON written by
bench/step.cpp: batch (prompts per step), group, max_new_tokens, steps (timed after one warm-up
step), threads, temperature, top_p, top_k, min_p, seed, beta, lr, eps_low, eps_high, loss_type,
scale_rewards, max_grad_norm, weight_decay, bf16 (optional), rewards ([{name, kind, function, pattern, weight}],
builtin math_match and regex_format), stop_ids, and prompts ([{text, ids, answer}], (steps + 1) *
batch of them, used in order).

Prints one JSON object: step_s (mean seconds per step over the timed steps, from a callback at the
start and end of each step), step_seconds, phases (rollout = generation, reward, old_ref_logp =
the no-grad logprob forwards, update = the rest: the loss forward, backward and AdamW),
response_tokens (completion tokens per step), same_prompt_ids (the fraction of prompts whose
tokenization here gives tandem's ids), versions and threads; or {"error": why}.
"""
import argparse
import contextlib
import json
import math
import os
import re
import sys
import tempfile
import time

# Nothing may reach the network: local files only, no experiment trackers, no GPU.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["WANDB_DISABLED"] = "true"
os.environ["WANDB_MODE"] = "disabled"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["CUDA_VISIBLE_DEVICES"] = ""

NUMBER = re.compile(r"[-+−]?\$?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:/\d+)?%?")


def extract_gsm8k(text):
    at = text.rfind("####")
    if at < 0:
        return None
    answer = text[at + 4:].split("\n", 1)[0].strip()
    return answer or None


def extract_boxed(text):
    at = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if at < 0:
        return None
    i = text.index("{", at) + 1
    depth, start = 1, i
    while i < len(text):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
        i += 1
    return None


def parse_number(text):
    s = text.strip().strip("$").replace(",", "").replace("−", "-").rstrip("%")
    try:
        if "/" in s:
            a, b = s.split("/", 1)
            return float(a) / float(b)
        return float(s)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(predicted, reference):
    p, r = parse_number(predicted), parse_number(reference)
    if r is not None and p is None:
        found = NUMBER.findall(predicted)
        p = parse_number(found[-1]) if found else None
    if p is not None and r is not None:
        return math.isclose(p, r, rel_tol=1e-9, abs_tol=0.0) or p == r
    norm = lambda s: s.replace(" ", "").replace("$", "").lower()
    return norm(predicted) == norm(reference)


def math_match(completions, answer, **_):
    """tandem's builtin math_match: \\boxed{}, else "#### n", else the last number, against the
    reference answer ("#### n" or the text), numerically."""
    out = []
    for completion, ref in zip(completions, answer):
        ref = extract_gsm8k(ref) or extract_boxed(ref) or ref.strip()
        pred = extract_boxed(completion) or extract_gsm8k(completion)
        if pred is None:
            found = NUMBER.findall(completion)
            pred = found[-1] if found else None
        out.append(1.0 if pred is not None and answers_match(pred, ref) else 0.0)
    return out


def regex_format(pattern):
    compiled = re.compile(pattern)

    def reward(completions, **_):
        return [1.0 if compiled.search(c) else 0.0 for c in completions]

    return reward


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--input", required=True)
    args = ap.parse_args()
    cfg = json.load(open(args.input))
    try:
        import torch
        import transformers
        import trl
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        print(json.dumps({"error": f"torch/transformers/trl not installed ({e}); run scripts/bench-peers"}))
        return 0
    torch.set_num_threads(cfg["threads"])

    reward_funcs, weights = [], []
    for r in cfg["rewards"]:
        if r["kind"] == "builtin" and r["function"] == "math_match":
            fn = math_match
        elif r["kind"] == "builtin" and r["function"] == "regex_format":
            fn = regex_format(r["pattern"])
        else:
            print(json.dumps({"error": f"reward '{r['name']}': only builtin math_match and regex_format have a peer"}))
            return 0
        fn.__name__ = r["name"]
        reward_funcs.append(fn)
        weights.append(r["weight"])

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    # TRL stops at the model's eos ids and the tokenizer's: make them tandem's stop tokens.
    model.generation_config.eos_token_id = list(cfg["stop_ids"])

    prompts = cfg["prompts"]
    same = sum(tokenizer(p["text"])["input_ids"] == p["ids"] for p in prompts)
    data = Dataset.from_list([{"prompt": p["text"], "answer": p["answer"]} for p in prompts])

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.t0, self.seconds, self.lengths = 0.0, [], []

        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                self.lengths.append(logs["completions/mean_length"])

    timer = StepTimer()
    samples = cfg["batch"] * cfg["group"]
    # One generation of every sample, then the update in micro-batches of 16 completions (one
    # optimizer step), as tandem packs its update under a token budget: the whole batch of 64 in
    # one forward holds (64, T, V) f32 logits several times over.
    micro = 16 if samples % 16 == 0 else samples
    # The Trainer prints its logs on stdout: keep stdout for the one result line.
    with tempfile.TemporaryDirectory(prefix="tandem-bench-trl-") as out, \
            contextlib.redirect_stdout(sys.stderr):
        config = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=micro,  # completions per forward/backward
            gradient_accumulation_steps=samples // micro,  # generation batch: batch x group
            num_generations=cfg["group"],
            max_completion_length=cfg["max_new_tokens"],
            max_steps=cfg["steps"] + 1,
            num_iterations=1,
            gradient_checkpointing=False,  # TRL's default recomputes the forward; tandem does not
            learning_rate=cfg["lr"],
            lr_scheduler_type="constant",
            weight_decay=cfg["weight_decay"],
            max_grad_norm=cfg["max_grad_norm"],
            beta=cfg["beta"],
            epsilon=cfg["eps_low"],
            epsilon_high=cfg["eps_high"],
            loss_type=cfg["loss_type"],
            scale_rewards=cfg["scale_rewards"],
            reward_weights=weights,
            temperature=cfg["temperature"],
            top_p=cfg["top_p"],
            top_k=cfg["top_k"],
            min_p=cfg["min_p"] or None,
            shuffle_dataset=False,
            seed=cfg["seed"],
            use_vllm=False,
            use_cpu=True,
            bf16=bool(cfg.get("bf16", False)),  # torch.autocast on the CPU, f32 weights
            fp16=False,
            report_to="none",
            logging_steps=1,
            save_strategy="no",
            log_completions=False,
            dataloader_num_workers=0,
            disable_tqdm=True,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=reward_funcs, args=config, train_dataset=data,
                              processing_class=tokenizer, callbacks=[timer])

        # Phases: wrap the trainer's generation, reward and logprob methods with timers.
        phase = {"rollout": [], "reward": [], "old_ref_logp": []}

        def timed(fn, name, only_no_grad=False):
            def wrapper(*a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    if not only_no_grad or not torch.is_grad_enabled():
                        phase[name].append((len(timer.seconds), time.perf_counter() - t0))
            return wrapper

        trainer._generate = timed(trainer._generate, "rollout")
        trainer._calculate_rewards = timed(trainer._calculate_rewards, "reward")
        trainer._get_per_token_logps_and_entropies = timed(
            trainer._get_per_token_logps_and_entropies, "old_ref_logp", only_no_grad=True)
        trainer.train()

    if len(timer.seconds) != cfg["steps"] + 1:
        print(json.dumps({"error": f"timed {len(timer.seconds)} steps, expected {cfg['steps'] + 1}"}))
        return 0
    timed_steps = timer.seconds[1:]
    step_s = sum(timed_steps) / len(timed_steps)
    phases = {name: sum(t for step, t in v if step >= 1) / len(timed_steps) for name, v in phase.items()}
    phases["update"] = step_s - sum(phases.values())
    lengths = timer.lengths[1:]
    print(json.dumps({
        "step_s": step_s,
        "step_seconds": timed_steps,
        "phases": phases,
        "response_tokens": samples * sum(lengths) / max(len(lengths), 1),
        "same_prompt_ids": same / len(prompts),
        "trl": trl.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__.split("+")[0],
        "threads": torch.get_num_threads(),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
