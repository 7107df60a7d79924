"""The seeds' API as their readers type it (``from rl_primitives import quick_start_training``),
over this project's implementation: the user's design documents (``../shared/seeds/``) name
these functions and records, and ``docs/seeds.md`` maps each to ours (preferred) and says
which seed shapes are refused and why (the seeds' known errors, seeds README 1 to 9).

A facade, the top of the import rooms (like ``cluster.jobs``): it imports the primitives, the
loop and the local backend, and nothing imports it. Training runs in this process on
``cluster.local.LocalBackend``; the same loop runs on Ray through ``rayrl rl job.yaml``.
"""
from primitives.env.rewards import (
    compute_scalar_reward,
    compute_vector_reward,
    keyword_reward,
    lexicographic_aggregator,
    max_aggregator,
    mean_aggregator,
    min_aggregator,
    min_threshold_aggregator,
    weighted_sum_aggregator,
)
from primitives.env.rollouts import create_rollouts
from primitives.env.tools import ToolCall, ToolConfig, ToolResult, safe_calculate
from primitives.io.data import PromptItem, make_prompt_source, prompt_source_from_loader
from primitives.io.loggers import update_ema_metrics
from primitives.maths.algorithms import dapo, get_algorithm, grpo, online_dpo, piecewise_schedule, reinforce
from primitives.maths.filters import top_bottom_pairs
from primitives.maths.kl import (
    create_confidence_masked_kl,
    create_ema_updater,
    create_periodic_updater,
    create_reference_model,
    create_truncated_kl,
)
from primitives.model.vllm_generation import vllm_generator
from primitives.types import Conversation, Generation, Message, ModelConfig, Rollout, RolloutBatch
from rl_primitives.api import (
    Batch,
    GenerationConfig,
    aggregate_vector_rewards,
    compute_grpo_advantages,
    compute_grpo_loss,
    compute_per_token_kl,
    compute_reward_model_score,
    create_algorithm_config,
    create_batch_rollouts,
    create_multiturn_rollout,
    create_ref_update_fn,
    create_rm_reward_fn,
    create_rollout,
    execute_and_track_tools,
    generate,
    generate_with_logprobs,
    get_reference_logprobs,
    load_model,
    load_reward_model,
    load_tokenizer,
)
from rl_primitives.loop import (
    TrainingState,
    TrainingStats,
    load_checkpoint,
    log_to_console,
    log_to_wandb,
    quick_start_training,
    save_checkpoint,
    train,
    training_iteration,
    training_step,
)
from rl_primitives.plan import (
    PyTorchTrainingBackend,
    RayTrainingBackend,
    Sample,
    TrainFuture,
    TrainingConfig,
    collate_batch,
    grpo_loss,
    nll_loss,
    prepare_sft_batch,
    run_sft_training,
)
from rl_primitives.plan_rl import (
    AsyncRolloutManager,
    DataBuffer,
    HFInferenceEngine,
    RLTrainingConfig,
    RolloutConfig,
    SampleBatch,
    SGLangEngine,
    compute_advantages,
    compute_reward,
    generate_rollout_batches,
    prepare_grpo_batch,
    run_rl_training,
    sync_weights_to_engines,
)
from rl_primitives.ref_cache import ReferenceLogprobCache, cached_ref_logprobs
from rl_primitives.seed_data import compute_loss_mask, load_sft_samples, tokenize_conversation
from rl_primitives.seed_maths import (
    compute_batch_kl,
    compute_dapo_loss,
    compute_dapo_pairs,
    compute_forward_kl,
    compute_kl,
    compute_loss_by_algorithm,
    compute_policy_gradient_loss,
    compute_ppo_loss,
    compute_reinforce_loss,
    compute_reverse_kl,
    copy_params,
    create_dapo_config,
    create_ema_model,
    create_grpo_config,
    create_kl_schedule,
    create_ppo_config,
    get_algorithm_config,
    get_algorithm_for_iteration,
    normalize_rewards,
    reset_if_needed,
)
from rl_primitives.seed_models import (
    compute_logprobs_for_tokens,
    compute_ppo_advantages,
    parse_thinking,
    update_reference_model,
)
from rl_primitives.seed_rewards import combine_rewards, length_reward, safety_check_reward
from rl_primitives.seed_tools import (
    apply_chat_template,
    apply_reward_shaping,
    batch_generate,
    compute_batch_rewards,
    execute_tools,
    extract_tool_calls,
    format_prompt,
    generate_conversation_turn,
    parse_tool_calls,
    track_tool_calls,
    track_tool_stats,
)
from rl_primitives.utilities import inspect_rollout, plot_training_curves, validate_batch

select_top_bottom_pairs = top_bottom_pairs  # the seeds' name (seeds/000, example 4)
create_adaptive_kl = create_confidence_masked_kl  # the seeds' name (seeds/003): k3 on tokens the policy is sure of

__all__ = [
    "AsyncRolloutManager", "Batch", "Conversation", "DataBuffer", "Generation", "GenerationConfig", "HFInferenceEngine",
    "Message", "ModelConfig", "PromptItem", "PyTorchTrainingBackend", "RLTrainingConfig", "RayTrainingBackend",
    "ReferenceLogprobCache", "Rollout", "RolloutBatch", "RolloutConfig", "SGLangEngine", "Sample", "SampleBatch",
    "ToolCall", "ToolConfig", "ToolResult", "TrainFuture", "TrainingConfig", "TrainingState", "TrainingStats",
    "aggregate_vector_rewards", "apply_chat_template", "apply_reward_shaping", "batch_generate", "cached_ref_logprobs",
    "collate_batch", "combine_rewards", "compute_advantages", "compute_batch_kl", "compute_batch_rewards",
    "compute_dapo_loss", "compute_dapo_pairs", "compute_forward_kl", "compute_grpo_advantages", "compute_grpo_loss",
    "compute_kl", "compute_logprobs_for_tokens", "compute_loss_by_algorithm", "compute_loss_mask",
    "compute_per_token_kl", "compute_policy_gradient_loss", "compute_ppo_advantages", "compute_ppo_loss",
    "compute_reinforce_loss", "compute_reverse_kl", "compute_reward", "compute_reward_model_score",
    "compute_scalar_reward", "compute_vector_reward", "copy_params", "create_adaptive_kl", "create_algorithm_config",
    "create_batch_rollouts", "create_confidence_masked_kl", "create_dapo_config", "create_ema_model",
    "create_ema_updater", "create_grpo_config", "create_kl_schedule", "create_multiturn_rollout",
    "create_periodic_updater", "create_ppo_config", "create_ref_update_fn", "create_reference_model",
    "create_rm_reward_fn", "create_rollout", "create_rollouts", "create_truncated_kl", "dapo",
    "execute_and_track_tools", "execute_tools", "extract_tool_calls", "format_prompt", "generate",
    "generate_conversation_turn", "generate_rollout_batches", "generate_with_logprobs", "get_algorithm",
    "get_algorithm_config", "get_algorithm_for_iteration", "get_reference_logprobs", "grpo", "grpo_loss",
    "inspect_rollout", "keyword_reward", "length_reward", "lexicographic_aggregator", "load_checkpoint", "load_model",
    "load_reward_model", "load_sft_samples", "load_tokenizer", "log_to_console", "log_to_wandb", "make_prompt_source",
    "max_aggregator", "mean_aggregator", "min_aggregator", "min_threshold_aggregator", "nll_loss", "normalize_rewards",
    "online_dpo", "parse_thinking", "parse_tool_calls", "piecewise_schedule", "plot_training_curves",
    "prepare_grpo_batch", "prepare_sft_batch", "prompt_source_from_loader", "quick_start_training", "reinforce",
    "reset_if_needed", "run_rl_training", "run_sft_training", "safe_calculate", "safety_check_reward",
    "save_checkpoint", "select_top_bottom_pairs", "sync_weights_to_engines", "tokenize_conversation",
    "top_bottom_pairs", "track_tool_calls", "track_tool_stats", "train", "training_iteration", "training_step",
    "update_ema_metrics", "update_reference_model", "validate_batch", "vllm_generator", "weighted_sum_aggregator",
]
