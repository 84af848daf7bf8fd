"""Schema of ``policy.generation.vllm_cfg``: vLLM's engine options, NeMo RL's spellings."""

from __future__ import annotations

from nrl_core.api import Field, Section

#: vLLM's cache dtypes nrl passes on (fp8 ones need a GPU, or AVX-512 or AMX on CPU).
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")

VLLM_CFG = Section(doc="vLLM engine options (the vllm generation backend).", fields={
    "tensor_parallel_size": Field(type=int, default=1, minimum=1,
                                  doc="ranks per engine (vLLM tensor parallel); the generation ranks hold "
                                      "ranks / tensor_parallel_size independent engines"),
    "pipeline_parallel_size": Field(type=int, default=1, choices=(1,),
                                    doc="accepted for NeMo RL configs; nrl runs engines without pipeline parallelism"),
    "sleep_level": Field(type=int, default=1, choices=(1, 2),
                         doc="colocated, between generations: 1 parks the weights in host memory, 2 drops them "
                             "(the next refit reloads them); vLLM sleep mode, GPUs only"),
    "gpu_memory_utilization": Field(type=float, default=0.6,
                                    doc="fraction of GPU memory vLLM may claim (GPU only; see kv_cache_space_gb)"),
    "max_model_len": Field(type=int, default=None, nullable=True, minimum=2,
                           doc="prompt + response tokens; null: policy.max_total_sequence_length"),
    "enforce_eager": Field(type=bool, default=False, doc="skip CUDA graphs / compilation"),
    "async_engine": Field(type=bool, default=False,
                          doc="vLLM's AsyncLLM (engine core in a child process): requests finish independently, "
                              "which async GRPO needs; one rank per engine"),
    "precision": Field(type=str, default=None, nullable=True,
                       choices=("float32", "bfloat16", "float16", "auto", "fp8"),
                       doc="null: policy.precision; fp8 (NeMo RL) is refused by the config check"),
    "kv_cache_space_gb": Field(type=float, default=None, nullable=True,
                               doc="CPU KV cache in GiB (what VLLM_CPU_KVCACHE_SPACE sets; the variable wins if set); "
                                   "null: sized for the run's largest generation batch (nrl_gen_vllm/kv_cache.py)"),
    "load_format": Field(type=str, default="dummy", choices=("dummy", "auto"),
                         doc="dummy: the engine starts with placeholder weights and the first refit loads the "
                             "policy's (NeMo RL's choice for training: the checkpoint is read once, by the policy); "
                             "auto: the engine reads policy.model_name itself"),
    "max_lora_rank": Field(type=int, default=64,
                           doc="with policy.refit.adapters: the largest LoRA rank the engine serves (vLLM's "
                               "values: 1, 8, 16, 32, 64, ...)"),
    "expert_parallel_size": Field(type=int, default=1, minimum=1,
                                  doc="vLLM expert parallelism across the engine's tensor-parallel ranks (1 or "
                                      "tensor_parallel_size; MoE models): each rank holds a share of the experts, "
                                      "attention stays tensor parallel"),
    "seed": Field(type=int, default=None, nullable=True,
                  doc="base sampling seed; null: policy.seed, else the algorithm's seed"),
    "kv_cache_dtype": Field(type=str, default="auto", choices=KV_CACHE_DTYPES,
                            doc="the KV cache's element type, vLLM's kv_cache_dtype (auto: the model's dtype); fp8 "
                                "halves the cache of a bfloat16 model and changes what attention reads"),
    "logprobs_mode": Field(type=str, default="processed_logprobs", choices=("processed_logprobs",),
                           doc="the engine reports each token's logprob under the distribution it was sampled from "
                               "(after temperature, top-k, top-p), which the policy's logprobs reproduce; vLLM's "
                               "raw modes would make the importance ratio compare two different distributions"),
    "use_tqdm": Field(type=bool, default=False, doc="vLLM's progress bar for each synchronous generation"),
    # NeMo RL keys accepted so copied configs validate; they change nothing here.
    "use_deep_gemm": Field(type=bool, default=False, inert=True),
    "num_last_layers_in_bf16": Field(type=int, default=0, inert=True),
    "num_first_layers_in_bf16": Field(type=int, default=0, inert=True),
    "skip_tokenizer_init": Field(type=bool, default=False, inert=True),
})
