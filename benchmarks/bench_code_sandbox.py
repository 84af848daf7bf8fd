"""Code sandbox throughput: programs/s through the pool of sandbox workers (Ray actors) against the
same programs one by one in this process, in the same run.

    python benchmarks/bench_code_sandbox.py [--programs 96] [--workers 2] [--repeats 3]

The programs are the canonical solutions of generated code tasks (``data.dataset_name: code``)
run against their tests, one sandbox per test, as the environment runs them. The pool is started
(and its workers probe their sandboxes) before timing; each figure is the best of ``--repeats``,
the two ways alternating. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--programs", type=int, default=96)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from nrl_core.cluster import init_ray, shutdown_ray
    from nrl_env_code.checks import program_for, tests_of
    from nrl_env_code.data import code_splits
    from nrl_env_code.extract import extract_code
    from nrl_env_code.pool import LocalRunner, SandboxPool

    records, _ = code_splits(num_train=args.programs, num_val=0, tests_per_task=1, seed=0)
    programs = []
    for record in records:
        code = extract_code(record["expected_answer"])
        assert code is not None
        programs += [program_for(code, test, 5.0)[0] for test in tests_of({"tests": record["tests"]})]
    programs = programs[: args.programs]

    init_ray({"num_cpus": os.cpu_count() or 1})
    local, pool = LocalRunner({}), SandboxPool({}, args.workers)
    best = {"one by one": float("inf"), f"pool of {args.workers}": float("inf")}
    try:
        for _ in range(args.repeats):
            for name, runner in zip(best, (local, pool)):
                start = time.perf_counter()
                results = runner.run(programs)
                best[name] = min(best[name], time.perf_counter() - start)
                assert all(r.ok for r in results), [r for r in results if not r.ok][:1]
    finally:
        pool.shutdown()
        shutdown_ray()
    rates = {name: len(programs) / seconds for name, seconds in best.items()}
    one, pooled = rates.values()
    print(f"{'way':<14} {'programs':>8} {'seconds':>8} {'programs/s':>11}")
    for name, seconds in best.items():
        print(f"{name:<14} {len(programs):>8} {seconds:>8.2f} {rates[name]:>11.1f}")
    print(f"pool / one by one: {pooled / one:.2f}x on {os.cpu_count()} CPUs")
    print(json.dumps({"programs": len(programs), "workers": args.workers, "cpus": os.cpu_count(),
                      "one_by_one_per_s": round(one, 2), "pool_per_s": round(pooled, 2),
                      "ratio": round(pooled / one, 3)}))


if __name__ == "__main__":
    main()
