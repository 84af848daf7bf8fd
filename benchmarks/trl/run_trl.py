"""TRL's side of benchmarks/bench_grpo_vs_trl.py: GRPOTrainer for a few steps, per-step wall clock to JSON.

Runs in TRL's own venv (benchmarks/trl/make_venv.sh), never in nrl's. The benchmark passes every
setting on the command line; this script only maps them onto ``GRPOConfig`` so that one
generation batch (``--prompts-per-step`` x ``--generations`` completions) feeds exactly one
optimizer step: ``per_device_train_batch_size`` = the batch, ``gradient_accumulation_steps`` 1,
``steps_per_generation`` 1, ``num_iterations`` 1. Generation is HF ``generate`` (TRL's default, no
vLLM). The reward is nrl's own answer check (``nrl_env_math.verify.verify_response``, imported from
this checkout's source; its only dependency, math-verify, is in TRL's venv at nrl's pin), 1.0 for a
correct answer and 0.0 otherwise, as the ``math`` environment scores by default.

Output JSON: ``step_end_unix`` (``time.time()`` at each ``on_step_end``), ``train_begin_unix``,
``process_create_unix`` (the kernel's start time of this process, 10 ms resolution),
``first_step_end_from_process_start_s``, ``completion_tokens`` per step
(TRL's logged ``completions/mean_length`` x completions), ``reward`` per step, ``threads``.

    benchmarks/.venv-trl/bin/python benchmarks/trl/run_trl.py --model DIR --prompts FILE.jsonl --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF model directory (with its tokenizer)")
    p.add_argument("--prompts", required=True, help="JSONL: {'problem': str, 'expected_answer': str} per line")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--generations", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--beta", type=float, default=0.01)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--adam-beta2", type=float, default=0.99)
    p.add_argument("--adam-eps", type=float, default=1e-8)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--epsilon", type=float, default=0.2, help="ratio clip (nrl: loss_fn.ratio_clip_min/max)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import psutil
    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(REPO / "plugins" / "nrl_env_math" / "src"))
    from nrl_env_math.verify import verify_response  # stdlib-only at import; math-verify for non-identical answers

    records = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["problem"]}],
                                  "expected_answer": r["expected_answer"]} for r in records])

    def math_reward(completions, expected_answer, **_):
        return [1.0 if verify_response(c[0]["content"], gold) else 0.0 for c, gold in zip(completions, expected_answer)]

    clock: dict = {"step_end_unix": [], "train_begin_unix": None}

    class StepClock(TrainerCallback):
        def on_train_begin(self, *_, **__):
            clock["train_begin_unix"] = time.time()

        def on_step_end(self, *_, **__):
            clock["step_end_unix"].append(time.time())

    batch = args.prompts_per_step * args.generations
    config = GRPOConfig(
        output_dir=str(Path(args.out).parent / "trl-output"), max_steps=args.steps, seed=args.seed,
        per_device_train_batch_size=batch, gradient_accumulation_steps=1, steps_per_generation=1,
        num_iterations=1, num_generations=args.generations, max_completion_length=args.max_new_tokens,
        temperature=args.temperature, top_p=1.0, top_k=0, beta=args.beta, epsilon=args.epsilon,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=args.adam_beta2, adam_epsilon=args.adam_eps, optim="adamw_torch",
        max_grad_norm=args.max_grad_norm, use_cpu=True, bf16=False, fp16=False,
        model_init_kwargs={"dtype": "float32"}, use_vllm=False, logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True, dataloader_num_workers=0, log_completions=False)
    trainer = GRPOTrainer(model=args.model, reward_funcs=math_reward, args=config, train_dataset=dataset,
                          callbacks=[StepClock()])
    trainer.train()
    logs = [row for row in trainer.state.log_history if "completions/mean_length" in row]
    created = psutil.Process().create_time()
    result = {**clock, "process_create_unix": created, "first_step_end_from_process_start_s":
              clock["step_end_unix"][0] - created if clock["step_end_unix"] else None, "threads": torch.get_num_threads(),
              "completion_tokens": [row["completions/mean_length"] * batch for row in logs],
              "reward": [row.get("reward") for row in logs], "torch": torch.__version__,
              "trl": __import__("trl").__version__, "transformers": __import__("transformers").__version__}
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
