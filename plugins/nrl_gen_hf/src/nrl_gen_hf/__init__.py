"""nrl-gen-hf: the ``hf`` generation backend of nrl.

Rollouts through transformers' ``generate`` on the policy's own model class, so GRPO runs where
vLLM cannot be installed (a bare GPU machine with only PyTorch, or any CPU). Importing this
package imports neither torch nor transformers; :mod:`nrl_gen_hf.worker` does, when a worker is
built, so ``nrl plugins`` and config checks stay fast.
"""

__version__ = "0.1.2"
