"""The conformance suite lives in the package now (``vllm_dist.testing``); kept for old imports."""

from vllm_dist.testing.conformance import *  # noqa: F403
