#!/usr/bin/env python3
"""Golden values of tandem's GRPO math (trainer/grpo.h), from the formulas' definitions.

Every formula is written here in torch float64 on padded (B, L) tensors with a mask, the way verl's
core_algos.py writes them; d loss / d logp and d loss / d entropy come from autograd. Inputs are
random float32 values (stored exactly), so tandem reads the very numbers torch used.

Writes tests/golden/grpo/advantages.json and tests/golden/grpo/policy_loss.json, which the
[interop] test "GRPO advantages and losses match the torch goldens" compares to 1e-6 of the largest
golden value.

Regenerate (from the repository root; torch from PyPI, any recent version):
    python3 -m venv /tmp/venv-grpo && /tmp/venv-grpo/bin/pip install torch numpy
    /tmp/venv-grpo/bin/python tests/golden/make_grpo_golden.py
"""
import json
import math
import os

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "grpo")
f64 = torch.float64


def f32(values):
    """Float32-representable python floats (so that JSON round-trips them exactly)."""
    return [float(v) for v in np.asarray(values, dtype=np.float32)]


# ---- Advantages -----------------------------------------------------------------------------------


def advantages(rewards, sizes, baseline, scale, eps):
    r = torch.tensor(rewards, dtype=f64)
    out = torch.zeros_like(r)
    batch_std = torch.std(r)  # unbiased
    begin = 0
    for n in sizes:
        g = r[begin:begin + n]
        if n == 1 or bool(torch.all(g == g[0])):
            begin += n  # zero variance (or a group of one): advantage 0 by convention
            continue
        if baseline == "leave-one-out":
            centred = g - (g.sum() - g) / (n - 1)
        else:
            centred = g - g.mean()
        if scale == "group-std":
            centred = centred / (torch.std(g) + eps)
        elif scale == "batch-std":
            centred = centred / (batch_std + eps)
        out[begin:begin + n] = centred
        begin += n
    return out.tolist()


def advantage_cases(rng):
    sizes = [4, 8, 5, 1, 6, 4, 7]
    rewards = []
    for i, n in enumerate(sizes):
        if i == 5:
            rewards += [0.75] * n  # zero-variance group
        elif i % 2 == 0:
            rewards += list(rng.integers(0, 2, n).astype(float))  # 0/1 rule rewards
        else:
            rewards += list(rng.normal(0.0, 1.5, n))
    rewards = f32(rewards)
    cases = []
    for baseline in ["group-mean", "leave-one-out"]:
        for scale in ["group-std", "batch-std", "none"]:
            for eps in [1e-6, 1e-2]:
                if scale == "none" and eps != 1e-6:
                    continue
                cases.append({
                    "baseline": baseline, "scale": scale, "eps": eps,
                    "advantages": advantages(rewards, sizes, baseline, scale, eps),
                })
    return {"rewards": rewards, "group_sizes": sizes, "cases": cases}


# ---- Policy loss ----------------------------------------------------------------------------------


def make_inputs(rng, extreme=False):
    lens = [int(x) for x in rng.integers(1, 12, 9)]
    T = sum(lens)
    adv = rng.normal(0.0, 1.0, len(lens))
    adv[2] = 0.0
    old = -rng.uniform(0.01, 4.0, T)
    logp = old + rng.normal(0.0, 0.3, T)
    ref = old + rng.normal(0.0, 0.4, T)
    roll = old + rng.normal(0.0, 0.3, T)
    ent = rng.uniform(0.0, 3.0, T)
    if extreme:  # hit the clamps: log-ratio > 20 (GSPO mean > 10), KL input > 20, k3 output > 10
        logp[:lens[0]] = old[:lens[0]] + 25.0
        adv[0] = abs(adv[0]) + 0.1  # A > 0: the clip bounds the huge ratio
        ref[1] = logp[1] + 30.0
        ref[3] = logp[3] + 4.0
        ref[4] = logp[4] - 25.0
        roll[5] = old[5] - 30.0
    return {"seq_lens": lens, "advantages": f32(adv), "logp": f32(logp), "old_logp": f32(old),
            "ref_logp": f32(ref), "rollout_logp": f32(roll), "entropy": f32(ent)}


def policy_loss(cfg, x, norm):
    lens = x["seq_lens"]
    B, L = len(lens), max(lens)
    mask = torch.zeros(B, L, dtype=f64)

    def pad(name):
        out = torch.zeros(B, L, dtype=f64)
        t = 0
        for i, n in enumerate(lens):
            out[i, :n] = torch.tensor(x[name][t:t + n], dtype=f64)
            mask[i, :n] = 1.0
            t += n
        return out

    lp = pad("logp").requires_grad_()
    ent = pad("entropy").requires_grad_()
    old, ref, roll = pad("old_logp"), pad("ref_logp"), pad("rollout_logp")
    length = torch.tensor(lens, dtype=f64)
    A = torch.tensor(x["advantages"], dtype=f64)[:, None]

    if cfg["ratio_level"] == "sequence":
        # GSPO, verl's stop-gradient form: value s_i, gradient s_i per token.
        seq = ((lp - old) * mask).sum(-1) / length
        log_s = lp - lp.detach() + seq.detach()[:, None]
        ratio = torch.exp(torch.clamp(log_s, max=10.0))
    else:
        ratio = torch.exp(torch.clamp(lp - old, -20.0, 20.0))
    on = mask > 0
    r = ratio.detach()
    metrics = {
        "clipped_low": int(((A < 0) & (r < 1.0 - cfg["eps_low"]) & on).sum()) if cfg["clip"] else 0,
        "clipped_high": int(((A > 0) & (r > 1.0 + cfg["eps_high"]) & on).sum()) if cfg["clip"]
        else 0,
        "ratio_min": float(r[on].min()), "ratio_max": float(r[on].max()),
        "kl_old_k3_sum": float(((torch.exp(old - lp.detach()) - (old - lp.detach()) - 1.0)[on])
                               .sum()),
    }
    pg1 = -A * ratio
    if cfg["clip"]:
        pg2 = -A * torch.clamp(ratio, 1.0 - cfg["eps_low"], 1.0 + cfg["eps_high"])
        pg = torch.maximum(pg1, pg2)
    else:
        pg = pg1
    if cfg["dual_clip_c"] > 0:
        pg = torch.where(A < 0, torch.minimum(pg, -A * cfg["dual_clip_c"]), pg)
    if cfg["is_level"] != "none":
        d = old - roll
        if cfg["is_level"] == "sequence":
            d = (d * mask).sum(-1, keepdim=True).expand(B, L)  # product of token weights
        w = torch.exp(torch.clamp(d, -20.0, 20.0))
        if cfg["is_mode"] == "truncate":
            w = torch.clamp(w, max=cfg["is_cap"])
        else:
            w = torch.where(w > cfg["is_cap"], torch.zeros_like(w), w)
        pg = pg * w
        metrics["is_weight_sum"] = float(w[on].sum())
    per_token = pg
    if cfg["kl_beta"] > 0:
        xk = torch.clamp(ref - lp, -20.0, 20.0)
        if cfg["kl_estimator"] == "k1":
            k = -xk
        elif cfg["kl_estimator"] == "k2":
            k = 0.5 * xk * xk
        else:
            k = torch.exp(xk) - xk - 1.0
        k = torch.clamp(k, -10.0, 10.0)
        metrics["kl_ref_sum"] = float(k.detach()[on].sum())
        per_token = per_token + cfg["kl_beta"] * k
    if cfg["entropy_coef"] > 0:
        per_token = per_token - cfg["entropy_coef"] * ent
    per_token = per_token * mask
    agg = cfg["aggregation"]
    if agg == "token-mean":
        loss = per_token.sum() / norm["global_tokens"]
    elif agg == "seq-mean-token-mean":
        loss = (per_token.sum(-1) / length).sum() / norm["global_sequences"]
    elif agg == "seq-mean-token-sum-norm":
        loss = per_token.sum(-1).sum() / (cfg["seq_sum_norm"] * norm["global_sequences"])
    else:
        loss = per_token.sum()
    loss.backward()

    def unpad(t):
        if t is None:
            t = torch.zeros(B, L, dtype=f64)
        return [float(v) for i, n in enumerate(lens) for v in t[i, :n].tolist()]

    if cfg["ratio_level"] == "sequence" and agg == "seq-mean-token-mean" and not cfg["clip"] \
            and cfg["is_level"] == "none" and cfg["kl_beta"] == 0 and cfg["entropy_coef"] == 0:
        # The GSPO paper's own form: loss_i = -A_i exp(mean log r), no stop-gradient trick.
        lp2 = lp.detach().clone().requires_grad_()
        s = torch.exp(torch.clamp(((lp2 - old) * mask).sum(-1) / length, max=10.0))
        paper = (-A[:, 0] * s).sum() / norm["global_sequences"]
        paper.backward()
        assert torch.allclose(paper, loss.detach()) and torch.allclose(lp2.grad, lp.grad)
    return float(loss.detach()), unpad(lp.grad), unpad(ent.grad), metrics


BASE = {"ratio_level": "token", "clip": True, "eps_low": 0.2, "eps_high": 0.2, "dual_clip_c": 0.0,
        "aggregation": "token-mean", "seq_sum_norm": 16.0, "kl_estimator": "k3", "kl_beta": 0.0,
        "entropy_coef": 0.0, "is_level": "none", "is_mode": "truncate", "is_cap": 2.0}


def variants():
    v = []
    for agg in ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "token-sum"]:
        v.append((f"vanilla {agg}", {"aggregation": agg}))
    v.append(("no clip", {"clip": False}))
    v.append(("dual clip", {"dual_clip_c": 3.0}))
    v.append(("dual clip tight", {"dual_clip_c": 1.1, "aggregation": "token-sum"}))
    v.append(("clip-higher", {"eps_low": 0.1, "eps_high": 0.28}))
    v.append(("gspo paper form", {"ratio_level": "sequence", "clip": False,
                                  "aggregation": "seq-mean-token-mean"}))
    v.append(("gspo", {"ratio_level": "sequence", "eps_low": 0.0003, "eps_high": 0.0004,
                       "aggregation": "seq-mean-token-mean"}))
    v.append(("gspo token-mean", {"ratio_level": "sequence", "eps_high": 0.28}))
    for k in ["k1", "k2", "k3"]:
        v.append((f"kl {k}", {"kl_estimator": k, "kl_beta": 0.1}))
    for level in ["token", "sequence"]:
        for mode in ["truncate", "mask"]:
            cap = 1.3 if level == "token" else 2.0
            v.append((f"is {level} {mode}", {"is_level": level, "is_mode": mode, "is_cap": cap}))
    v.append(("entropy bonus", {"entropy_coef": 0.01}))
    v.append(("everything", {"eps_high": 0.28, "dual_clip_c": 3.0, "kl_beta": 0.04,
                             "kl_estimator": "k3", "entropy_coef": 0.005, "is_level": "token",
                             "is_mode": "truncate", "is_cap": 1.5,
                             "aggregation": "seq-mean-token-sum-norm"}))
    v.append(("everything gspo", {"ratio_level": "sequence", "kl_beta": 0.04, "kl_estimator": "k2",
                                  "entropy_coef": 0.005, "is_level": "sequence", "is_mode": "mask",
                                  "is_cap": 2.0, "aggregation": "seq-mean-token-mean"}))
    return v


def policy_loss_cases(rng):
    cases = []
    for extreme in [False, True]:
        x = make_inputs(rng, extreme)
        norm = {"global_tokens": len(x["logp"]) + 13, "global_sequences": len(x["seq_lens"]) + 3}
        for name, over in variants():
            if extreme and not (name.startswith("kl") or name in ("vanilla token-mean",
                                                                   "gspo token-mean",
                                                                   "is token truncate")):
                continue
            cfg = dict(BASE, **over)
            loss, dlogp, dent, metrics = policy_loss(cfg, x, norm)
            cases.append({"name": name + (" extreme" if extreme else ""), "config": cfg,
                          "inputs": x, "normalisers": norm, "loss": loss, "dlogp": dlogp,
                          "dentropy": dent, "metrics": metrics})
    return cases


def main():
    rng = np.random.default_rng(20261201)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "advantages.json"), "w") as f:
        json.dump(advantage_cases(rng), f)
    cases = policy_loss_cases(rng)
    with open(os.path.join(OUT, "policy_loss.json"), "w") as f:
        json.dump({"torch": torch.__version__, "cases": cases}, f)
    for c in cases:
        assert math.isfinite(c["loss"])
    print(f"wrote {OUT}: {len(cases)} policy-loss cases")


if __name__ == "__main__":
    main()
