"""nrl_core.generation_kit (what every generation backend shares), and the install line a config
gets when it selects a first-party generation backend that is not installed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nrl_core.algorithms.installed import choose_backends, load_and_validate
from nrl_core.errors import ConfigError, NrlError
from nrl_core.generation_kit import SLEEP_TAGS, SamplingSettings, SamplingState, SleepState, derive_seed
from nrl_core.plugins import reset_plugin_manager


def test_sampling_settings_normalise_what_off_means():
    s = SamplingSettings.from_generation({"temperature": 0.7, "top_p": None, "top_k": None,
                                          "max_new_tokens": None, "stop_token_ids": None, "stop_strings": None})
    assert s == SamplingSettings(max_new_tokens=512, temperature=0.7, top_p=1.0, top_k=None,
                                 stop_token_ids=(), stop_strings=())
    for off in (0, -1, None):
        assert SamplingSettings.from_generation({"temperature": 1.0, "top_k": off}).top_k is None
    s = SamplingSettings.from_generation({"temperature": 1.0, "top_k": 20, "top_p": 0.9, "max_new_tokens": 8,
                                          "stop_token_ids": [2, 3], "stop_strings": ["\n\n"]})
    assert (s.top_k, s.top_p, s.max_new_tokens, s.stop_token_ids, s.stop_strings) == (20, 0.9, 8, (2, 3), ("\n\n",))


def test_sampling_settings_build_the_subclass_they_are_called_on():
    class Engine(SamplingSettings):
        def knob(self) -> int:
            return 0 if self.top_k is None else self.top_k

    s = Engine.from_generation({"temperature": 1.0, "top_k": 5})
    assert isinstance(s, Engine) and s.knob() == 5


def test_temperature_zero_and_greedy_do_not_sample():
    assert SamplingSettings.from_generation({"temperature": 1.0}).samples(greedy=False)
    assert not SamplingSettings.from_generation({"temperature": 1.0}).samples(greedy=True)
    assert not SamplingSettings.from_generation({"temperature": 0.0}).samples(greedy=False)


def test_derived_seeds_are_stable_distinct_and_63_bit():
    # the value a seed had before the kit (vLLM's request_seed): resumed runs sample the same tokens
    assert derive_seed(42, 0, 0, 0) == 5044792007642101364
    seeds = {derive_seed(base, engine, call, index)
             for base in (0, 1, -5) for engine in range(3) for call in range(3) for index in range(3)}
    assert len(seeds) == 81 and all(0 <= s < 2**63 for s in seeds)


def test_sampling_state_counts_calls_and_round_trips():
    state = SamplingState(seed=42, weight_version=-1)
    assert state.next_call() == 0 and state.next_call() == 1
    saved = state.as_dict()
    assert saved == {"calls": 2, "seed": 42, "weight_version": -1}
    call = state.next_call()
    first = [state.seed_for(0, call, i) for i in range(2)]
    fresh = SamplingState(seed=7)
    fresh.load(saved)
    assert fresh == SamplingState(seed=42, weight_version=-1, calls=2)
    call = fresh.next_call()
    assert [fresh.seed_for(0, call, i) for i in range(2)] == first == [derive_seed(42, 0, 2, i) for i in range(2)]
    fresh.load({"calls": 5})  # seed and version are optional
    assert (fresh.calls, fresh.seed, fresh.weight_version) == (5, 42, -1)


def test_sleep_state_tracks_what_is_awake():
    state = SleepState("test engine 3")
    assert state.awake == set(SLEEP_TAGS)
    state.require_awake("generate")
    assert state.sleep() == set(SLEEP_TAGS) and state.awake == set()
    with pytest.raises(NrlError, match=r"^test engine 3: generate while its kv_cache, weights sleep; "
                                       r"call prepare_for_generation first$"):
        state.require_awake("generate")
    assert state.to_wake(["weights"]) == {"weights"} and state.awake == set()  # asking changes nothing
    assert state.wake(["weights"]) == {"weights"}
    state.require_awake("import_weights", ("weights",))
    with pytest.raises(NrlError, match="generate while its kv_cache sleep"):
        state.require_awake("generate")
    assert state.wake(["weights"]) == set()  # already awake
    assert state.wake(None) == {"kv_cache"} and state.awake == set(SLEEP_TAGS)
    with pytest.raises(ValueError, match=r"unknown sleep tags \['optimizer'\]"):
        state.wake(["optimizer", "weights"])


def test_the_kit_imports_without_torch():
    code = ("import sys; import nrl_core.generation_kit; "
            "assert 'torch' not in sys.modules, 'generation_kit imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("backend, section, distribution", [
    ("vllm", "vllm_cfg: {tensor_parallel_size: 1}", "nrl-gen-vllm"),
    ("hf", "hf_cfg: {batch_size: 4}", "nrl-gen-hf"),
])
def test_an_uninstalled_generation_backend_names_its_distribution(write, monkeypatch, backend, section,
                                                                  distribution):
    """Its section is accepted (not 'unknown key'), and the backend's miss says what to install."""
    path = write("c.yaml", "policy: {model_name: /m, dtensor_cfg: {enabled: true}, "
                           f"generation: {{backend: {backend}, {section}}}}}\n")
    monkeypatch.setenv("NRL_BLOCKED_PLUGINS", "vllm,hf")  # as if neither were installed
    reset_plugin_manager()
    try:
        with pytest.raises(ConfigError) as info:
            choose_backends(load_and_validate(path))
    finally:
        reset_plugin_manager()  # the next manager is built after monkeypatch restored the variable
    message = str(info.value)
    assert info.value.key_path == "policy.generation.backend" and "\n" not in message
    assert f"generation backend '{backend}' is not available" in message
    assert message.endswith(f"pip install {distribution}")
