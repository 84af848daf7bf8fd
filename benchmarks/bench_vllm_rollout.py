"""Rollout throughput: nrl's vLLM generation worker vs HF ``generate`` and vs ``vllm.LLM.generate``.

Same model (the ~25M-parameter "bench" Llama), same 64 prompts, 128 new tokens, temperature 1.
The direct-vLLM run uses exactly the SamplingParams nrl builds (so both generate the same tokens)
and the ratio is nrl's overhead; HF runs one batched ``generate`` (left-padded) and counts the
tokens it generated up to each sequence's EOS.

    python benchmarks/bench_vllm_rollout.py [--prompts 64] [--new-tokens 128] [--repeats 3]

Prints a table and one JSON line. Timings are the best of ``--repeats`` after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _best(fn, repeats: int) -> tuple[float, object]:
    fn()  # warm-up
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def _best_interleaved(fns: list, repeats: int) -> list[tuple[float, object]]:
    """Best time of each function, the runs alternating so drift in the machine's speed hits all alike."""
    for fn in fns:
        fn()  # warm-up
    best: list[list] = [[float("inf"), None] for _ in fns]
    for _ in range(repeats):
        for slot, fn in zip(best, fns):
            start = time.perf_counter()
            result = fn()
            elapsed = time.perf_counter() - start
            if elapsed < slot[0]:
                slot[0], slot[1] = elapsed, result
    return [(t, r) for t, r in best]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--size", default="bench")
    parser.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nrl_core.testing.tiny_models import cached_tiny_model
    from nrl_gen_vllm.worker import VllmGenerationWorker

    model_dir = str(cached_tiny_model("llama", args.size))
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok(f"Q: What is {i} + {i * 7 % 100}?\nA:").input_ids for i in range(args.prompts)]
    config = {"grpo": {"seed": 0}, "policy": {
        "model_name": model_dir, "precision": "float32", "max_total_sequence_length": 512,
        "generation": {"max_new_tokens": args.new_tokens, "temperature": 1.0, "top_p": 1.0, "top_k": None,
                       "vllm_cfg": {"enforce_eager": args.enforce_eager}}}}
    worker = VllmGenerationWorker(config)
    n_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())

    # nrl: the worker's generate (token-id prompts, per-request seeds, logprobs, output conversion)
    state = worker.sampling_state()

    def nrl_run():
        worker.load_sampling_state(state)
        return worker.generate(prompts)

    # vLLM directly, same requests and params
    from vllm.inputs import TokensPrompt

    from nrl_gen_vllm.sampling import request_seed

    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    params = [worker._sampling.params(max_tokens=args.new_tokens, seed=request_seed(state["seed"], 0, state["calls"], i),
                                      greedy=False) for i in range(len(prompts))]
    (t_nrl, out), (t_vllm, vout) = _best_interleaved(
        [nrl_run, lambda: worker.llm.generate(requests, params, use_tqdm=False)], args.repeats)
    nrl_tokens = sum(len(ids) for ids in out.token_ids)
    vllm_tokens = sum(len(o.outputs[0].token_ids) for o in vout)

    # HF generate, batched, left-padded
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok.padding_side = "left"
    batch = tok.pad({"input_ids": prompts}, return_tensors="pt")

    def hf_run():
        with torch.no_grad():
            return hf.generate(**batch, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                               max_new_tokens=args.new_tokens, pad_token_id=tok.pad_token_id)

    t_hf, hout = _best(hf_run, max(1, args.repeats - 1))
    gen = hout[:, batch["input_ids"].shape[1]:]
    hf_tokens = 0
    for row in gen.tolist():
        hf_tokens += (row.index(tok.eos_token_id) + 1) if tok.eos_token_id in row else len(row)

    rows = {"nrl_vllm": (t_nrl, nrl_tokens), "vllm_direct": (t_vllm, vllm_tokens), "hf_generate": (t_hf, hf_tokens)}
    result = {name: {"seconds": round(t, 3), "tokens": n, "tokens_per_s": round(n / t, 1)} for name, (t, n) in rows.items()}
    result["speedup_vs_hf"] = round(result["nrl_vllm"]["tokens_per_s"] / result["hf_generate"]["tokens_per_s"], 2)
    result["nrl_overhead_vs_vllm"] = round(t_nrl / t_vllm - 1, 4)
    result["model_params"] = n_params
    result["setup"] = {"prompts": args.prompts, "new_tokens": args.new_tokens, "enforce_eager": args.enforce_eager,
                       "torch_threads": torch.get_num_threads()}
    print(f"model {args.size}: {n_params / 1e6:.1f}M params, {args.prompts} prompts x {args.new_tokens} new tokens")
    for name, (t, n) in rows.items():
        print(f"  {name:12s} {t:7.2f} s  {n:6d} tokens  {n / t:8.1f} tok/s")
    print(f"  nrl vs HF generate: {result['speedup_vs_hf']}x; nrl overhead vs vllm.LLM.generate: "
          f"{100 * result['nrl_overhead_vs_vllm']:+.1f}%")
    print(json.dumps(result))
    worker.shutdown()


if __name__ == "__main__":
    main()
