"""Async GRPO through ``nrl train`` (examples/configs/grpo_tiny_cpu_async.yaml: one training worker,
one engine on vLLM's async engine). Every rollout a step trains on is in its
``train_data_step<N>.jsonl`` with the weight version that sampled it, so the staleness bound is
checked on every trajectory of the run. A weight decay and a KL penalty make the weights and the
loss move, so that equal losses mean equal computations."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from nrl_core.cluster.gcs_watch import _descendants
from tests.e2e.test_grpo import assert_ok, metrics, run_nrl
from tests.launch import driving_the_shared_ray

pytestmark = pytest.mark.slow

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "configs" / "grpo_tiny_cpu_async.yaml"
MOVES = ["policy.optimizer.kwargs.lr=0.02", "policy.optimizer.kwargs.weight_decay=1.0",
         "loss_fn.reference_policy_kl_penalty=0.1", "policy.generation.max_new_tokens=6"]


def small(model: Path, *overrides: str) -> list[str]:
    return [f"policy.model_name={model}", "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4",
            "policy.train_global_batch_size=16", "policy.train_micro_batch_size=8", "policy.logprob_batch_size=16",
            "grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false", "data.generate.num_train=64",
            "data.generate.num_val=8", *MOVES, *overrides]


def rollouts(tmp: Path, step: int) -> list[dict]:
    lines = (tmp / "logs" / f"train_data_step{step}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_no_trajectory_is_older_than_the_bound_before_and_after_a_resume(tmp_path, model):
    timeline = tmp_path / "timeline.jsonl"
    assert_ok(run_nrl(tmp_path, CONFIG, "grpo", small(model, "grpo.max_num_steps=2"), env={"NRL_TIMELINE": str(timeline)}))
    check_the_engine_imported_while_the_driver_checked_the_config(timeline)
    assert_ok(run_nrl(tmp_path, CONFIG, "grpo", small(model, "grpo.max_num_steps=3")))  # resumes after step 2
    ages = {step: [(step - 1) - row["weight_version"] for row in rollouts(tmp_path, step)] for step in range(1, 4)}
    assert all(len(a) == 16 for a in ages.values())
    assert all(0 <= age <= 1 for a in ages.values() for age in a), ages  # every trajectory within the bound
    assert set(ages[2]) == {1}  # step 2's rollouts were generated while step 1 trained
    assert set(ages[3]) == {0}  # after the resume: regenerated with the restored weights
    rows = [r for r in metrics(tmp_path) if "async/trajectory_age_max" in r]
    assert [r["step"] for r in rows][-3:] == [1, 2, 3] and all(r["async/trajectory_age_max"] <= 1 for r in rows)


def check_the_engine_imported_while_the_driver_checked_the_config(timeline: Path) -> None:
    """An engine that is not colocated has its own actor, launched right after the policy's and
    before the driver's config checks end: it imports vLLM meanwhile (without failures), and the
    engine is built on that same actor. When its imports start relative to the end of the checks
    depends on how warm Ray's worker pool and the driver are, so it is not asserted."""
    events = [json.loads(line) for line in timeline.read_text().splitlines()]
    launched = next(e for e in events if e["event"] == "generation_launched")
    validated = next(e for e in events if e["event"] == "config_validated")
    assert launched["t"] < validated["t"]
    preloaded = [e for e in events if e["event"] == "preloaded" and e["group"].startswith("generation-")]
    assert preloaded and all(e["failed"] == 0 for e in preloaded)
    engine_actors = {e["pid"] for e in events if e["event"] == "actor_start" and e["group"].startswith("generation-")}
    built = {e["pid"] for e in events if e["event"] == "worker_built" and "nrl_gen_vllm" in e["worker"]}
    assert engine_actors == built and len(built) == 1


IN_FLIGHT = ["grpo.async_grpo.enabled=true", "grpo.async_grpo.in_flight_weight_updates=true",
             "loss_fn.use_importance_sampling_correction=true"]  # launches the engines' hosts for it
TP2 = ["cluster.gpus_per_node=3", "policy.generation.colocated.resources.gpus_per_node=2",
       "policy.generation.vllm_cfg.tensor_parallel_size=2"]


def test_max_age_zero_is_the_synchronous_loop_also_at_tensor_parallel_2(tmp_path, model):
    """Async GRPO with a trajectory age of 0 is the synchronous loop, and its engine here is
    vLLM's async engine at tensor parallel 2 (NeMo RL's async recipes): the engine's first rank runs
    both workers through vLLM's own executor, the second holds its place, and every refit reaches
    both workers. The twin is the synchronous loop on one rank."""
    sync, async_ = tmp_path / "sync", tmp_path / "async"
    sync.mkdir(), async_.mkdir()
    timeline = async_ / "timeline.jsonl"
    assert_ok(run_nrl(sync, CONFIG, "grpo", small(model, "grpo.max_num_steps=2", "grpo.async_grpo.enabled=false")))
    assert_ok(run_nrl(async_, CONFIG, "grpo", small(model, "grpo.max_num_steps=2",
                                                     "grpo.async_grpo.max_trajectory_age_steps=0", *TP2),
                      env={"NRL_TIMELINE": str(timeline)}))
    ready = sorted((e["rank"], e["tensor_parallel"], e["follower"])
                   for e in map(json.loads, timeline.read_text().splitlines()) if e["event"] == "vllm_engine_ready")
    assert ready == [(0, 2, False), (1, 2, True)]
    for step in (1, 2):
        assert rollouts(async_, step) == rollouts(sync, step)  # same prompts, tokens, rewards, versions
    for a, s in zip(metrics(async_), metrics(sync)):
        assert a["async/trajectory_age_max"] == 0
        # exp(mean |log p_engine - log p_policy|): the engine sampled with the policy's weights
        assert a["train/token_mult_prob_error"] == pytest.approx(1.0, abs=1e-3)
        for key in ("train/loss", "train/kl_penalty", "train/token_mult_prob_error", "train/grad_norm"):
            assert a[key] == pytest.approx(s[key], rel=1e-5, abs=1e-8), key
    assert metrics(sync)[-1]["train/kl_penalty"] > 0  # the weights moved: equal losses are not all zeros


def _strike_mid_run(tmp_path: Path, model: Path, pick_victim, sig: int, *overrides: str) -> tuple[str, float, int]:
    """A run on a Ray of its own until step 2's rollouts are written; then ``sig`` to the process
    ``pick_victim(run_pid, stderr_lines)`` names. Returns the run's stderr, the seconds it took to
    end after the signal and the victim's pid; asserts that nothing of the run is left."""
    args = [sys.executable, "-m", "nrl_core.cli", "train", "grpo", "--config", str(CONFIG),
            *small(model, "grpo.max_num_steps=100000", "checkpointing.enabled=false", f"logger.log_dir={tmp_path}/logs",
                   "logger.plot=false", *overrides)]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a Ray of the run's own, counted below
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            env={**env, "NRL_STRICT_PLUGINS": "1", "VLLM_LOGGING_LEVEL": "WARNING"})
    stderr: list[str] = []
    threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True).start()  # type: ignore[arg-type]
    victim, ray_processes = None, []
    try:
        deadline = time.monotonic() + 300
        while not list(tmp_path.glob("logs/train_data_step2.jsonl")):  # the run is under way
            assert proc.poll() is None and time.monotonic() < deadline, "".join(stderr)[-3000:]
            time.sleep(0.5)
        victim = pick_victim(proc.pid, list(stderr))
        ray_processes = _descendants([proc.pid])
        struck_at = time.monotonic()
        os.kill(victim, sig)
        proc.wait(timeout=180)
        exited_after = time.monotonic() - struck_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        # the run's own kills are under way as it exits: a process freeing a large address space
        # takes a moment to go, on a loaded host longer than half a second
        watched = _descendants([proc.pid]) + ([victim] if victim else []) + ray_processes
        gone_by = time.monotonic() + TEARDOWN_S
        while any(_not_zombie(pid) for pid in watched) and time.monotonic() < gone_by:
            time.sleep(0.2)
        left = {pid: _title(pid) for pid in watched if _not_zombie(pid)}
        for pid in left:  # resume and end what the run left, so that nothing outlives the test
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
    text = "".join(stderr)
    assert proc.returncode != 0, text[-3000:]
    assert not left, f"left running {TEARDOWN_S:.0f} s after the run: {left}\n{text[-3000:]}"
    return text, exited_after, victim


def _title(pid: int, limit: int | None = 120) -> str:
    """A process's title (its command line, as vLLM and Ray set it), for naming what was left."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:limit]
    except OSError:
        return "?"


def _engine_pid(stderr: list[str]) -> int:
    [engine] = [int(line.split("rank 0 pid ")[1].split()[0]) for line in stderr if "generation-vllm: rank 0 pid" in line]
    return engine


def _titled(pids: list[int], prefix: str) -> list[int]:
    """Those of ``pids`` whose command line (a process title, as vLLM and Ray set them) starts with
    ``prefix``, or whose kernel name (the title's first 15 bytes) is the prefix's."""
    found = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/comm", "rb") as f:
                comm = f.read().strip()
        except OSError:
            continue
        if cmdline.startswith(prefix.encode()) or comm == prefix.encode()[:15]:
            found.append(pid)
    return found


def _awaited_title(root: int, prefix: str, within_s: float = 30.0, untitled: str | None = None) -> int:
    """The one descendant of ``root`` titled ``prefix``, polled for: on a loaded host a read of the
    process tree has come back without it while the run was in step 2 (CI, twice), so a miss is
    retried. Once ``within_s`` has passed, the one descendant whose command line contains
    ``untitled`` (the process before it titles itself) is taken instead; failing that, the error
    names every descendant with its parent and title."""
    deadline = time.monotonic() + within_s
    while True:
        tree = _descendants([root])
        found = _titled(tree, prefix)
        if len(found) == 1:
            return found[0]
        if time.monotonic() > deadline:
            fallback = [pid for pid in tree if untitled and untitled in _title(pid, limit=None)]
            if not found and len(fallback) == 1:
                return fallback[0]
            raise AssertionError(f"{len(found)} processes titled {prefix} under pid {root}; its tree: "
                                 + "; ".join(f"{pid} (parent {_parent(pid)}) {_title(pid)!r}" for pid in tree))
        time.sleep(0.5)


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def test_a_dead_engine_is_a_named_error_within_a_minute_and_nothing_is_left(tmp_path, model):
    text, exited_after, _ = _strike_mid_run(tmp_path, model, lambda run, stderr: _engine_pid(stderr), signal.SIGKILL)
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert errors, text[-3000:]
    assert "generation-vllm[rank 0]" in errors[0] and "died" in errors[0], errors[0]
    assert exited_after < 60, exited_after


# The watchdog's floor, low enough to fire soon after a stop, high enough that no phase of a
# healthy tiny step on a loaded 2-core host reaches it.
STOP_FLOOR = ["watchdog.floor_s=30"]
TEARDOWN_S = 5.0


def test_a_stopped_engine_core_is_named_itself_as_the_cause(tmp_path, model):
    """vLLM's asynchronous engine runs its engine core in a process it starts; stopped (SIGSTOP),
    the engine's actor still answers, so the hang line must name the core itself."""
    def core(run: int, stderr: list[str]) -> int:
        # vLLM starts its core with multiprocessing's spawn, and the core titles itself once started
        return _awaited_title(_engine_pid(stderr), "VLLM::EngineCore", untitled="spawn_main")

    text, _, victim = _strike_mid_run(tmp_path, model, core, signal.SIGSTOP, *STOP_FLOOR)
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: watchdog: phase "), text[-3000:]
    assert re.search(rf"\S+ pid {victim} \(started by generation-vllm\[rank 0\] pid \d+\) is stopped, state T: "
                     r"the likely cause", errors[0]), errors[0]


def test_a_stopped_environment_worker_is_named_with_its_stack(tmp_path, model):
    """The math environment's verifier, a Ray actor no worker group holds, stopped mid-run: the
    hang line names it (not the driver) and its stack is read without resuming it."""
    text, _, victim = _strike_mid_run(
        tmp_path, model, lambda run, stderr: _awaited_title(run, "ray::VerifierWorker"), signal.SIGSTOP,
        *STOP_FLOOR)
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: watchdog: phase "), text[-3000:]
    assert f"VerifierWorker actor pid {victim} is stopped, state T: the likely cause" in errors[0], errors[0]
    assert "the driver" not in errors[0].split("the likely cause")[0]
    [stack] = tmp_path.glob(f"logs/stacks/*/actor-VerifierWorker-pid{victim}.native.txt")
    assert "verif" in stack.read_text().lower(), stack.read_text()[-2000:]


def _not_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_importance_weights_use_the_logprobs_of_the_engine_and_version_that_sampled(model, ray_session):
    """Rollouts sampled at weight version 0, trained on after one optimizer step (version 1), as a
    rollout one step old is: the generation logprobs the loss divides by are the sampling engine's
    under version 0 (equal to the policy's at version 0, the reference weights here), not the
    current policy's."""
    from nrl_core.algorithms.grpo import RolloutGroup, merge_groups
    from nrl_core.algorithms.loss import ClippedPGLoss, NLLLoss
    from nrl_core.algorithms.rollouts import rollout_batch
    from tests.e2e.facades import chat_prompts, policy_and_generation, training_batch

    overrides = ["policy.generation.colocated.enabled=false", "policy.generation.colocated.resources.gpus_per_node=1",
                 "cluster.gpus_per_node=2", "policy.generation.vllm_cfg.async_engine=true",
                 "policy.optimizer.kwargs.lr=5e-3", "policy.generation.temperature=0.7"]
    with policy_and_generation(model, overrides) as (_, policy, generation):
        prompts = chat_prompts(model)
        groups = sorted(generation.generate_groups(prompts, 2))
        assert [i for i, _ in groups] == [0, 1, 2, 3] and {o.weight_version for _, o in groups} == {0}
        policy.train(training_batch(0), NLLLoss())  # version 1; the engine still holds version 0
        rollouts = merge_groups([RolloutGroup(prompt=None, output=o, rewards=[0.0, 0.0]) for _, o in groups])
        batch = rollout_batch([p for p in prompts for _ in range(2)], rollouts, pad_token_id=3)
        mask = batch.fields["token_mask"] > 0
        sampled_under = batch.fields["generation_logprobs"]
        version0 = policy.get_reference_logprobs(batch)  # the initial weights: version 0
        version1 = policy.get_logprobs(batch)
        assert float((sampled_under - version0).abs()[mask].max()) < 1e-3
        assert float((sampled_under - version1).abs()[mask].mean()) > 1e-2
        # the loss weighs each token by p_trainer / p_sampler of those logprobs
        batch.fields.update(prev_logprobs=version1, advantages=torch.ones_like(version1) * batch.fields["token_mask"],
                            reference_logprobs=version0)
        corrected = ClippedPGLoss(use_importance_sampling_correction=True)
        counts = batch.loss_counts()
        loss, _ = corrected(version1, batch, global_valid_tokens=counts[0], global_valid_seqs=counts[1])
        weights = (version1 - sampled_under).exp()
        assert float(loss) == pytest.approx(float(-(weights * batch.fields["token_mask"]).sum() / counts[0]), rel=1e-5)


@pytest.fixture(scope="module")
def ray_session():
    """The module's worker groups on the suite's shared Ray (their actors from the zygote)."""
    with driving_the_shared_ray():
        yield


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute-kv", "keep-kv"])
def test_an_in_flight_refit_lands_mid_generation_and_each_token_knows_its_version(model, ray_session, recompute):
    """The engine samples at version 0 while the policy is already at version 1; once a first
    group is back (a prompt with room for two tokens), the refit lands in the requests still in
    flight. The engine takes two sequences at a time, so the refit lands while a pair is mid-way
    however long it takes on a loaded host (with all at once, generation could finish first).
    Responses then carry versions 0 and then 1. The tokens of version 0 have the policy's
    version-0 logprobs. With ``recompute_kv_cache`` the requests recompute their KV cache with the
    new weights, so every token's generation logprob is the policy's under the version that token
    names and the importance weight of each token is p_trainer / p_that_version; keeping the cache
    (NeMo RL's default) the tokens of version 1 read keys and values version 0 computed, which the
    importance weights then carry."""
    from nrl_core.algorithms.async_rollouts import in_flight_metrics
    from nrl_core.algorithms.grpo import RolloutGroup, merge_groups
    from nrl_core.algorithms.loss import ClippedPGLoss, NLLLoss
    from nrl_core.algorithms.rollouts import rollout_batch
    from tests.e2e.facades import chat_prompts, policy_and_generation, training_batch

    overrides = ["policy.generation.colocated.enabled=false", "policy.generation.colocated.resources.gpus_per_node=1",
                 "cluster.gpus_per_node=2", "policy.generation.vllm_cfg.async_engine=true",
                 "policy.optimizer.kwargs.lr=5e-3", "policy.generation.temperature=0.7",
                 "policy.max_total_sequence_length=256", "policy.generation.vllm_cfg.max_model_len=256",
                 "policy.generation.max_new_tokens=160", "policy.generation.vllm_kwargs.max_num_seqs=2", *IN_FLIGHT]
    with policy_and_generation(model, overrides) as (_, policy, generation):
        generation.configure_in_flight(recompute_kv_cache=recompute)
        policy.train(training_batch(0), NLLLoss())  # version 1; the engine holds version 0
        generation.mark_stale()
        # the first has room for 2 tokens and is scheduled first: the others wait or are in flight
        prompts = [[5 + i % 400 for i in range(254)]] + chat_prompts(model)
        stream = generation.generate_groups(prompts, 2)
        groups = [next(stream)]
        assert groups[0][0] == 0
        assert generation.prepare(in_flight=True).version == 1
        groups += list(stream)
        groups = sorted(groups)[1:]
        rollouts = merge_groups([RolloutGroup(prompt=None, output=o, rewards=[0.0, 0.0]) for _, o in groups])
        versions = [rollouts.versions_of(i) for i in range(8)]
        assert all(v == sorted(v) and set(v) <= {0, 1} for v in versions)  # 0s, then 1s
        assert sum(len(set(v)) == 2 for v in versions) >= 1, versions  # a refit reached a response mid-way
        assert rollouts.weight_version == 0  # a response's version is its oldest token's
        metrics = in_flight_metrics([o for _, o in groups], step=2)
        assert 0 < metrics["async/in_flight_mixed_fraction"] <= 1
        assert 0 < metrics["async/token_age_mean"] < 1  # trained at step 2 with version 1: ages 0 and 1

        repeated = [p for p in prompts[1:] for _ in range(2)]
        batch = rollout_batch(repeated, rollouts, pad_token_id=3)
        at = torch.full(batch.input_ids.shape, -1)
        for i, (prompt, v) in enumerate(zip(repeated, versions)):
            at[i, len(prompt):len(prompt) + len(v)] = torch.tensor(v, dtype=torch.long)
        sampled_under = batch.fields["generation_logprobs"]
        version0, version1 = policy.get_reference_logprobs(batch), policy.get_logprobs(batch)
        old, new = at == 0, at == 1
        assert old.any() and new.any()
        assert float((sampled_under - version0).abs()[old].max()) < 1e-3
        assert float((sampled_under - version1).abs()[old].mean()) > 1e-2  # the two versions differ
        if not recompute:  # the stale cache shows in the logprobs of the later tokens of mixed responses
            mixed = old.any(dim=1, keepdim=True) & new
            assert float((sampled_under - version1).abs()[mixed].mean()) > 1e-2
            return
        assert float((sampled_under - version1).abs()[new].max()) < 1e-3
        # the loss weighs each token by p_trainer / p_sampler: 1 where the engine already had version 1
        batch.fields.update(prev_logprobs=version1, advantages=torch.ones_like(version1) * batch.fields["token_mask"],
                            reference_logprobs=version0)
        counts = batch.loss_counts()
        loss, _ = ClippedPGLoss(use_importance_sampling_correction=True)(
            version1, batch, global_valid_tokens=counts[0], global_valid_seqs=counts[1])
        weights = (version1 - sampled_under).exp()
        assert float(loss) == pytest.approx(float(-(weights * batch.fields["token_mask"]).sum() / counts[0]), rel=1e-5)
        assert float((weights - 1).abs()[new].max()) < 2e-3 and float((weights - 1).abs()[old].mean()) > 1e-2


def _send_an_unlisted_tensor_last(worker) -> None:
    """A training side whose export ends with a tensor its manifest never named."""
    real = type(worker).export_weights.__get__(worker)

    def export_weights(bucket_bytes, dtype):
        yield from real(bucket_bytes, dtype)
        yield [("model.layers.9.unlisted", torch.ones(8))]

    worker.export_weights = export_weights


def _pause_after_the_first_group(worker) -> None:
    """The async engine pauses, keeping its requests, once its first group is out: the refits land
    in requests still in flight however late they come (a loaded host once let every request finish
    first). Each load that fails records whether the engine is paused after it."""
    engine = worker._engine
    stream, end = engine.stream, engine._end
    engine.PAUSED_AFTER_TORN = []

    def paused_stream(*args):
        groups = stream(*args)
        first = next(groups)
        engine._run(engine.engine.pause_generation(mode="keep", clear_cache=False))
        yield first
        yield from groups

    async def recorded_end(succeeded, *args):
        await end(succeeded, *args)
        if not succeeded:
            engine.PAUSED_AFTER_TORN.append(await engine.engine.is_paused())

    engine.stream, engine._end = paused_stream, recorded_end


def _paused_after_torn(worker) -> list[bool]:
    return worker._engine.PAUSED_AFTER_TORN


def test_an_in_flight_refit_torn_part_way_keeps_the_requests_paused_until_a_refit_succeeds(model, ray_session):
    """The engine takes the in-flight refit in parts (small ones here); a tensor the manifest never
    named arrives after parts loaded, so the refit is torn, and the requests in flight stay paused
    (no token from torn weights). The next refit resumes them, and each response's tokens are
    version 0 and then 1. (The engine is held paused from its first group on, so the refits
    certainly find requests in flight.)"""
    from nrl_core.algorithms.grpo import RolloutGroup, merge_groups
    from nrl_core.algorithms.loss import NLLLoss
    from nrl_core.cluster._host import WorkerHost
    from nrl_core.refit.manifest import RefitError
    from tests.e2e.facades import chat_prompts, policy_and_generation, training_batch
    from tests.vllm.test_vllm_engines import _parts_loaded, _small_parts

    overrides = ["policy.generation.colocated.enabled=false", "policy.generation.colocated.resources.gpus_per_node=1",
                 "cluster.gpus_per_node=2", "policy.generation.vllm_cfg.async_engine=true",
                 "policy.optimizer.kwargs.lr=5e-3", "policy.max_total_sequence_length=256",
                 "policy.generation.vllm_cfg.max_model_len=256", "policy.generation.max_new_tokens=160",
                 "policy.generation.vllm_kwargs.max_num_seqs=2", *IN_FLIGHT]
    with policy_and_generation(model, overrides) as (_, policy, generation):
        generation.configure_in_flight(recompute_kv_cache=False)
        generation.hosts.call(WorkerHost.execute, _small_parts, on=0)
        generation.hosts.call(WorkerHost.execute, _pause_after_the_first_group, on=0)
        policy.train(training_batch(0), NLLLoss())
        generation.mark_stale()
        prompts = [[5 + i % 400 for i in range(254)]] + chat_prompts(model)
        stream = generation.generate_groups(prompts, 2)
        groups = [next(stream)]
        policy.group.call(WorkerHost.execute, _send_an_unlisted_tensor_last, on=0)
        with pytest.raises(RefitError, match=r"refit failed part-way: model\.layers\.9\.unlisted: unexpected"):
            generation.prepare(in_flight=True)
        policy.group.call(WorkerHost.execute, lambda worker: delattr(worker, "export_weights"), on=0)
        assert generation.prepare(in_flight=True).version == 1
        groups += list(stream)
        # (the host's calls wait behind its stream: counted once the stream is done) both refits in parts
        assert generation.hosts.call(WorkerHost.execute, _parts_loaded, on=0) > 4
        assert generation.hosts.call(WorkerHost.execute, _paused_after_torn, on=0) == [True]
        rollouts = merge_groups([RolloutGroup(prompt=None, output=o, rewards=[0.0, 0.0]) for _, o in sorted(groups)[1:]])
        versions = [rollouts.versions_of(i) for i in range(8)]
        assert all(v == sorted(v) and set(v) <= {0, 1} for v in versions) and any(1 in v for v in versions)


def test_in_flight_updates_reach_rollouts_mid_generation_and_the_bound_holds_for_every_token(tmp_path, model):
    """``in_flight_weight_updates``: long responses, so the trainer's refit after step ``t`` lands
    while step ``t + 1``'s rollouts are generating. Some responses then carry two weight versions
    (``token_weight_versions`` in ``train_data_step<N>.jsonl``); a rollout's version is its oldest
    token's, and every token of every rollout is within the age bound."""
    # Generating a step's rollouts must outlast training the step before, on a loaded machine too:
    # with two sequences at a time the engine takes eight turns of up to 96 tokens, about ten times
    # the training step (all sixteen at once, 256 tokens each, gave a margin of under two, and a
    # refit once missed every generation in the suite).
    long = ["policy.max_total_sequence_length=160", "policy.generation.vllm_cfg.max_model_len=160",
            "policy.generation.max_new_tokens=96", "policy.generation.vllm_kwargs.max_num_seqs=2",
            "grpo.async_grpo.in_flight_weight_updates=true"]
    assert_ok(run_nrl(tmp_path, CONFIG, "grpo", small(model, "grpo.max_num_steps=3", "checkpointing.enabled=false",
                                                      *long)))
    mixed = 0
    for step in (1, 2, 3):
        rows = rollouts(tmp_path, step)
        assert len(rows) == 16
        for row in rows:
            versions = row.get("token_weight_versions") or [row["weight_version"]] * len(row["response_token_ids"])
            assert len(versions) == len(row["response_token_ids"]) and versions == sorted(versions)
            assert row["weight_version"] == min(versions)
            assert all(0 <= (step - 1) - v <= 1 for v in versions), (step, versions)  # the bound, per token
            mixed += len(set(versions)) > 1
    assert mixed > 0  # a refit landed mid-generation
    rows = [r for r in metrics(tmp_path) if "async/in_flight_mixed_fraction" in r]
    assert [r["step"] for r in rows] == [1, 2, 3] and max(r["async/in_flight_mixed_fraction"] for r in rows) > 0
    assert all(r["async/trajectory_age_max"] <= 1 and 0 <= r["async/token_age_mean"] <= 1 for r in rows)
