"""Multi-turn rollouts, token in / token out.

A trajectory grows turn by turn and is never re-tokenized:

1. the prompt is the chat template applied to ``[system, first user message]`` (with the tools);
2. the policy generates an assistant turn up to its end token; those ids are appended as generated
   (loss mask 1) with their sampling log-probs;
3. the turn's text is given to the environment (which parses the tool call); the environment's reply
   (a tool result or the customer's message) is rendered by the chat template *as a delta* (the text
   the template puts between the assistant's end token and the next ``<|im_start|>assistant\\n``),
   tokenized once and appended (loss mask 0);
4. repeat until the environment ends the episode, or a turn limit, the total token budget or the
   per-turn token budget is reached (``Trajectory.ended_by`` records which; an episode cut by a limit
   has ``truncated`` set, as Gymnasium marks a time limit, and keeps the reward the environment gave).

:func:`check_template_consistency` compares the ids assembled this way with the chat template applied
to the final conversation and reports where and why they differ (a model may write a tool call whose
JSON the template renders differently, or split text into tokens the tokenizer would merge).

Generation runs behind one small interface (:class:`GenerationBackend`): :class:`HFBackend` (a
transformers model; batched, keeps each episode's KV cache between turns so that only the new tokens
are prefilled), :class:`VLLMBackend` (vLLM with token-id prompts, prefix caching and in-place
weight updates from the trainer's model) and :class:`AgentBackend` (a scripted agent).

Sampling log-probs are the log-probabilities of the sampled tokens under the distribution actually
sampled from: ``log_softmax(top_p_filter(logits / temperature))`` (``log_softmax(logits)`` when greedy,
``temperature == 0``). With ``temperature=1, top_p=1`` they are the policy's log-probs, as in training.

The modules: ``trajectory`` (config and records), ``collect`` (playing episodes), ``backend`` (the
interface and sampling), ``hf`` with its fast path ``hf_fast``, ``vllm_backend``, ``agent``, and
``inspection`` (template check, coloured tokens).
"""

from .agent import AgentBackend
from .backend import GenerationBackend, GenerationRequest, GenerationResult, sample_tokens
from .collect import ChatDelta, assistant_message, collect_rollouts, episode_seed
from .hf import HFBackend
from .inspection import TOKEN_COLOURS, TemplateCheck, check_template_consistency, legend_html, trajectory_html
from .trajectory import ENDED_BY, PackedRollouts, RolloutBatch, RolloutConfig, Trajectory
from .vllm_backend import VLLMBackend, VLLMWorkerExtension

__all__ = [
    "ENDED_BY", "TOKEN_COLOURS", "AgentBackend", "ChatDelta", "GenerationBackend", "GenerationRequest",
    "GenerationResult", "HFBackend", "PackedRollouts", "RolloutBatch", "RolloutConfig", "TemplateCheck",
    "Trajectory", "VLLMBackend", "VLLMWorkerExtension", "assistant_message", "check_template_consistency",
    "collect_rollouts", "episode_seed", "legend_html", "sample_tokens", "trajectory_html",
]
