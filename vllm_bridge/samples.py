"""Rollout samples: what the rollout side hands to the learner."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Sample:
    """One generated response to one prompt.

    logprobs[i] is the rollout log-probability of response_ids[i] under the sampling distribution
    actually used: vLLM "processed_logprobs" = log_softmax(logits / T) (after top-p/top-k masking
    when those are active), so temperature is honoured. versions[i] is the weight version that
    produced response_ids[i] (all equal for a synchronous generate(); per token so that partial /
    asynchronous rollouts that straddle a weight update can be represented).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # "stop" (EOS / stop token) or "length" (max_new_tokens reached)
    group: int  # index of the prompt in the generate() call; the G samples of a prompt share it
    reward: float = 0.0
    index_in_group: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 / 0: off
    info: dict = field(default_factory=dict)

    @property
    def num_response_tokens(self) -> int:
        return len(self.response_ids)

    @property
    def sequence(self) -> list[int]:
        """prompt + response token ids (what the learner re-scores)."""
        return list(self.prompt_ids) + list(self.response_ids)

    @property
    def min_version(self) -> int:
        return min(self.versions) if self.versions else -1

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"Sample: {n} response tokens but {len(self.logprobs)} logprobs and "
                f"{len(self.versions)} versions"
            )
