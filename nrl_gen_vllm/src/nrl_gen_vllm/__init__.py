"""nrl-gen-vllm: the ``vllm`` generation backend of nrl.

Importing this package does not import vLLM; :mod:`nrl_gen_vllm.worker` does, when a worker is
built, so ``nrl plugins`` and config checks stay fast.
"""

__version__ = "0.13.1"
