"""Registers the ``code`` environments (single- and multi-turn), the ``code`` generator and its processors.

Kept free of heavy imports (Ray) so listing plugins and checking a config stay fast; the classes
are named by import path and loaded only when a run builds them. Ray itself comes with nrl-core.
"""

from __future__ import annotations

from nrl_core.api import DataProcessorSpec, DatasetGeneratorSpec, EnvironmentSpec, Field, Section, hookimpl

NRL_CONTRACT = 14  # the plugin contract this distribution is written for (docs/plugins.md)

NUMBER = (int, float)

SANDBOX_SCHEMA = Section(doc="Where and how programs run (docs/reliability.md, 'Code sandbox').", fields={
    "uid": Field(type=int, default=1999999, minimum=1,
                 doc="the uid programs run as (outside their user namespace); one that no account or process uses"),
    "cpu_seconds": Field(type=int, default=10, minimum=1, doc="RLIMIT_CPU per run (SIGXCPU, then SIGKILL)"),
    "memory_mb": Field(type=int, default=512, minimum=32,
                       doc="memory per run, its files in memory and all its processes together (a memory cgroup), "
                           "and RLIMIT_AS per process"),
    "max_processes": Field(type=int, default=16, minimum=1,
                           doc="processes and threads per run (a pids cgroup, and RLIMIT_NPROC)"),
    "max_open_files": Field(type=int, default=64, minimum=8, doc="RLIMIT_NOFILE"),
    "file_size_mb": Field(type=int, default=16, minimum=1, doc="RLIMIT_FSIZE: the largest file a program may write"),
    "workdir_mb": Field(type=int, default=64, minimum=1, doc="size of the tmpfs work directory, the only writable place"),
    "output_limit_bytes": Field(type=int, default=65536, minimum=1024,
                                doc="stdout and stderr kept per run; more kills the run (limit 'output')"),
    "python": Field(type=str, default=None, nullable=True,
                    doc="the interpreter programs run with (null: the one running nrl); its prefix is made reachable"),
    "unsafe_no_isolation_trusted_code_only": Field(
        type=bool, default=False,
        doc="run programs with rlimits and timeouts only: no namespaces, as this user, with network and filesystem; "
            "for trusted code only (a warning says so)"),
    "unsafe_without_cgroup": Field(
        type=bool, default=False,
        doc="where no memory and pids cgroup is writable: run isolated with rlimits only, so memory is bounded per "
            "process and not with the run's files in memory (docs/reliability.md); without it such a host is refused"),
})

CODE_SCHEMA = Section(doc="Rewards from running the response's program against its task's tests in a sandbox.", fields={
    "num_workers": Field(type=int, default=2, minimum=0,
                         doc="Ray actors running sandboxes in parallel (NeMo RL's key); 0 runs them one by one in the "
                             "driver"),
    "reward_mode": Field(type=str, default="fraction", choices=("fraction", "all_or_nothing"),
                         doc="fraction: tests passed / tests; all_or_nothing: 1 only when every test passes"),
    "timeout_seconds": Field(type=NUMBER, default=5.0, doc="wall time per test (each test is its own run)"),
    "max_turns": Field(type=int, default=3, minimum=1,
                       doc="code_multi_turn: model turns before the episode ends unsolved"),
    "terminate_on_evaluation": Field(type=bool, default=False,
                                     doc="NeMo RL's key; code_multi_turn: end the episode after the first turn whose "
                                         "code ran, solved or not"),
    "excerpt_chars": Field(type=int, default=400, minimum=0,
                           doc="stdout and stderr kept per test in results and observations (the end of each)"),
    "cpus_per_worker": Field(type=NUMBER, default=0.1, doc="CPUs Ray reserves per worker (scheduling only)"),
    "startup_timeout_seconds": Field(type=NUMBER, default=120.0, doc="time a worker may take to start and probe"),
    "hang_grace_seconds": Field(type=NUMBER, default=30.0,
                                doc="a worker silent for its programs' limits + this is declared hung and replaced"),
    "sandbox": SANDBOX_SCHEMA,
})

MULTI_TURN_SCHEMA = CODE_SCHEMA


@hookimpl
def nrl_environments() -> list[EnvironmentSpec]:
    return [EnvironmentSpec(name="code", environment="nrl_env_code.environment:CodeEnvironment",
                            config_schema=CODE_SCHEMA, distribution="nrl-env-code",
                            description="programs from responses run against their tests in a sandbox (single-turn)"),
            EnvironmentSpec(name="code_multi_turn", environment="nrl_env_code.environment:CodeMultiTurnEnvironment",
                            config_schema=MULTI_TURN_SCHEMA, distribution="nrl-env-code", multi_turn=True,
                            description="write, run, read the interpreter's output, fix: until the tests pass "
                                        "(multi-turn)")]


@hookimpl
def nrl_dataset_generators() -> list[DatasetGeneratorSpec]:
    return [DatasetGeneratorSpec(name="code", generator="nrl_env_code.data:code_splits", distribution="nrl-env-code",
                                 description="seeded short programming tasks with stdin/stdout and assert tests")]


@hookimpl
def nrl_data_processors() -> list[DataProcessorSpec]:
    return [DataProcessorSpec(name="code", processor="nrl_env_code.data:code_processor", distribution="nrl-env-code",
                              description="a task's prompt; its tests go to the metadata"),
            DataProcessorSpec(name="code_sft", processor="nrl_env_code.data:code_sft_processor",
                              distribution="nrl-env-code",
                              description="a task's prompt and its canonical solution as a fenced block")]
